"""The other processes of a run, as the loop sees them.

The loop runs on one process (rank 0 under torchrun); work that other processes share is
announced to them with ``together(op, payload)`` and runs in its body on this process, in
step with theirs. The ops are the members of ``Op``: ``UPDATE`` (the step's update),
``GENERATE`` (a generate call spread over the ranks) and, when the modules are sharded,
``FORWARD`` (the passes without gradient), ``SYNC`` (the new weights to the engines), ``SAVE``
and ``LOAD`` (checkpoints). Which ops another process takes part in is the peers' business:
the loop announces every one. An op is a member, never its name as a string, so a misspelt
op fails where it is written, not as a rank waiting for a message it cannot match.
``Alone`` is the run without others; ``honing.backends.torchrun.Leader`` is rank 0's side of
several ranks, whose followers look each op up in one table (``torchrun.FOLLOWERS``).
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator
from typing import Any, Protocol

from honing.rollout.base import RolloutEngine


class Op(enum.Enum):
    """Work the ranks of a run share, announced by rank 0 (``Peers.together``)."""

    UPDATE = "update"
    GENERATE = "generate"
    FORWARD = "forward"
    SYNC = "sync"
    SAVE = "save"
    LOAD = "load"


def checked(op: Op) -> Op:
    """``op``, or a ``TypeError`` where it is not an ``Op`` (a string, say)."""
    if not isinstance(op, Op):
        raise TypeError(f"peers' ops are members of Op, not {op!r}")
    return op


class Peers(Protocol):
    def together(self, op: Op, payload: Any) -> contextlib.AbstractContextManager: ...

    def tell(self, value: Any) -> None: ...

    def weights_changed(self) -> None: ...

    def spread(self, engine: RolloutEngine, role: str = "engine") -> RolloutEngine: ...


class Alone:
    """No other process: shared work is this process's alone."""

    @contextlib.contextmanager
    def together(self, op: Op, payload: Any) -> Iterator[None]:
        checked(op)
        yield

    def tell(self, value: Any) -> None:
        """Within shared work, a value decided on the way (a save's directory): to nobody."""
        return None

    def weights_changed(self) -> None:
        """This process loaded other weights (a resume, a rollback): nobody to tell."""
        return None

    def spread(self, engine: RolloutEngine, role: str = "engine") -> RolloutEngine:
        """The engine generation uses: ``engine`` itself (``role``: the field of
        ``Components`` it is, ``engine`` or ``val_engine``)."""
        return engine
