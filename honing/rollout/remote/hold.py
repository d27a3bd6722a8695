"""One trainer at a time sends a server its weights.

Two trainers syncing into one server interleave their updates (and, on vLLM, their pause,
update and resume calls): the server samples from a mix of both, or a resume lands in the
middle of the other's update. So a server holds to one trainer: the first to send it weights
(each ``OpenAIEngine`` is a trainer, named by a random id in the ``X-Honing-Trainer``
header), and a weight update from any other is refused while that trainer is alive. Alive
means heard from within ``HOLD_S``: the trainer's ``Keeper`` renews its hold every
``RENEW_S`` until its engine closes, which lets go of it; one that died lets go ``HOLD_S``
after its last word. A trainer refused by a holder silent for longer than two renewals (most
likely dead: a run restarted after a crash finds its own former hold) waits for the hold to
lapse and asks once more (``lapses_in``).

The servers' side is ``Holder``: ``honing serve rollout`` answers a weight update or
``POST /update_weights/hold`` from another trainer with HTTP 409; honing's weight-transfer
backend in a vLLM server keeps one too, asked through ``/init_weight_transfer_engine``
before each sync pauses the server (``honing.rollout.remote.vllm_sender``).

Limits: a server without such a holder is not guarded (SGLang; a vLLM server on its ``nccl``
backend); a trainer stalled for longer than ``HOLD_S`` (stopped by a debugger, swapped out)
may find its server taken, and its next sync refused; an update sent by hand without the
header is refused while a trainer holds the server, and taken otherwise.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
import weakref
from collections.abc import Callable

TRAINER_HEADER = "X-Honing-Trainer"
HELD = "this server takes its weights from trainer"  # how a refusal reads
HOLD_S = 30.0  # a trainer not heard from for this long has let go of its servers
RENEW_S = 5.0  # how often a trainer renews its holds


def lapses_in(refusal: str) -> float | None:
    """Seconds until the hold a refusal names lapses, when its trainer has been silent for
    more than two renewals (it is most likely gone); None otherwise."""
    found = re.search(r"\(heard from (\d+) s ago\)", refusal)
    if found is None or HELD not in refusal:
        return None
    silent = float(found.group(1))
    return HOLD_S - silent + 1.0 if silent > 2 * RENEW_S else None


class HeldElsewhere(Exception):
    """A weight update from a trainer other than the one that holds the server."""


class Holder:
    """A server's side: the trainer that holds it, and when it was last heard from.

    Args:
        hold_s: how long a trainer's hold lasts after its last word.
        clock: seconds, monotonic (tests pass their own).
    """

    def __init__(self, hold_s: float = HOLD_S, clock: Callable[[], float] = time.monotonic):
        self.hold_s, self.clock = hold_s, clock
        self.trainer, self.heard = "", 0.0
        self.lock = threading.Lock()

    def hold(self, trainer: str) -> None:
        """Gives ``trainer`` (its id; "" for an update sent by hand) the server, or renews
        its hold; "" takes nothing.

        Raises:
            HeldElsewhere: another trainer holds it.
        """
        with self.lock:
            now = self.clock()
            since = now - self.heard
            if self.trainer and self.trainer != trainer and since < self.hold_s:
                who = f"trainer {trainer}" if trainer else "an update without a trainer id"
                raise HeldElsewhere(
                    f"{who} refused: {HELD} {self.trainer} (heard from {since:.0f} s ago); "
                    "one trainer at a time: "
                    f"stop that one, or wait until {self.hold_s:.0f} s after it stopped"
                )
            if trainer:
                self.trainer, self.heard = trainer, now

    def release(self, trainer: str) -> None:
        """``trainer`` lets go of the server (its engine closed)."""
        with self.lock:
            if trainer and trainer == self.trainer:
                self.trainer = ""


class Keeper:
    """A trainer's side: renews its holds on the servers that took its weights every
    ``every_s`` on a daemon thread, until ``close``; an engine that is dropped without
    being closed stops being renewed (the thread keeps only a weak reference to it).

    Args:
        owner: the engine; ``renew(owner, url)`` renews a hold (its errors are ignored: a
            server that is down is the engine's business, one taken by another trainer
            refuses the next sync).
    """

    def __init__(self, owner, renew: Callable, every_s: float = RENEW_S) -> None:
        self.urls: set[str] = set()
        self.stopped = threading.Event()
        self.lock = threading.Lock()
        self._started = False
        self._thread = threading.Thread(
            target=_renew_until_stopped,
            args=(weakref.ref(owner), renew, self, every_s),
            name="honing-weight-hold",
            daemon=True,
        )

    def add(self, url: str) -> None:
        """``url`` holds to this trainer: renewed from now on."""
        with self.lock:
            self.urls.add(url)
            if not self._started and not self.stopped.is_set():
                self._started = True
                self._thread.start()

    def held(self) -> list[str]:
        with self.lock:
            return sorted(self.urls)

    def close(self) -> list[str]:
        """Stops renewing; returns the servers held, to let go of."""
        self.stopped.set()
        return self.held()


def _renew_until_stopped(owner_ref, renew: Callable, keeper: Keeper, every_s: float) -> None:
    while not keeper.stopped.wait(every_s):
        owner = owner_ref()
        if owner is None:
            return
        for url in keeper.held():
            with contextlib.suppress(Exception):  # the next sync reports what matters
                renew(owner, url)
        del owner
