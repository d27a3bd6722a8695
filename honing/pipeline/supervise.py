"""``honing train ... --max-restarts N``: run training as a child process, restart it on a crash.

The child is ``python -m honing.cli train ARGS``; each restart runs it again with
``--resume auto``, so it continues from the newest checkpoint whose manifest verifies. What
counts as a crash: death by a signal (``kill -9``, the OOM killer, a segfault) or an exit status
other than the ones that mean "do not try again":

    0    the run finished
    2    a user error (bad config, data, full disk, another run writing the run directory):
         the same input fails the same way
    3    stopped by an alert rule (``RunStopped``)
    130  interrupted by Ctrl-C
    143  terminated by SIGTERM (the scheduler, or the supervisor passing its own on)

Each restart is logged and appended to ``RUN_DIR/events.jsonl`` as a ``restart`` event with the
exit status. SIGTERM sent to the supervisor is passed to the child and ends supervision; Ctrl-C
in a terminal reaches both (same process group), and the supervisor then waits for the child.

Limits: restarts are bounded by count, not by time; a crash that repeats at the same step uses
them all up. The supervisor itself is not supervised.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from honing.errors import UserError

NO_RESTART = frozenset({0, 2, 3, 130, 143})
EVENTS_FILE = "events.jsonl"


def is_crash(status: int) -> bool:
    """Whether a child's return code (negative: killed by that signal) calls for a restart."""
    return status < 0 or status not in NO_RESTART


def exit_status(returncode: int) -> int:
    """A ``Popen.returncode`` as a shell exit status: death by signal N becomes 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def _option(argv: Sequence[str], name: str) -> str | None:
    """The value of ``--name VALUE`` or ``--name=VALUE`` in ``argv`` (the last one wins)."""
    value = None
    for index, item in enumerate(argv):
        if item == name and index + 1 < len(argv):
            value = argv[index + 1]
        elif item.startswith(f"{name}="):
            value = item.split("=", 1)[1]
    return value


def without_option(argv: Sequence[str], name: str) -> list[str]:
    """``argv`` with every ``--name VALUE`` / ``--name=VALUE`` removed."""
    out, skip = [], False
    for item in argv:
        if skip:
            skip = False
        elif item == name:
            skip = True
        elif not item.startswith(f"{name}="):
            out.append(item)
    return out


def fixed_output_dir(argv: Sequence[str]) -> tuple[list[str], Path]:
    """Pins the run directory, so every restart continues the same run.

    Returns:
        ``argv`` with ``--output-dir`` added when it was missing (the default name holds the
        start time, which a restart must not change), and that directory.
    """
    given = _option(argv, "--output-dir")
    if given is not None:
        return list(argv), Path(given)
    from honing.pipeline.run import default_output_dir

    positional = [a for a in argv if not a.startswith("-") and "=" not in a]
    run_dir = default_output_dir(positional[0] if positional else None)
    return [*argv, "--output-dir", str(run_dir)], run_dir


def append_event(run_dir: Path, kind: str, **fields) -> None:
    """Appends ``{"time", "kind", **fields}`` to ``RUN_DIR/events.jsonl`` (the child is dead,
    so nobody else is writing it), as the run's own sink does: whole lines only.

    Raises:
        UserError: The file cannot be written (a full disk).
    """
    from honing.monitor.sinks import JsonlSink

    sink = JsonlSink(run_dir / EVENTS_FILE)
    try:
        sink.append([{"time": time.time(), "kind": kind, **fields}])
    finally:
        sink.close()


def _describe(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with status {returncode}"


def supervise(
    argv: Sequence[str],
    max_restarts: int,
    log: Callable[[str], None],
    *,
    on_start: Callable[[int], None] | None = None,
    restart_delay_s: float = 1.0,
    python: str = sys.executable,
) -> int:
    """Runs ``honing train ARGV`` in a child process and restarts it after crashes.

    Args:
        argv: The arguments of ``honing train`` (config, overrides, options), without
            ``--max-restarts``. The first start uses them as given; restarts replace any
            ``--resume`` with ``--resume auto``.
        max_restarts: How many times a crashed child is started again (>= 0).
        log: Receives one line per start and restart.
        on_start: Called with the child's pid after each start (fault injection uses it).
        restart_delay_s: Pause before a restart, so a crash loop does not spin.
        python: Interpreter for the child.

    Returns:
        The last child's exit status (128 + N when it died by signal N).
    """
    if max_restarts < 0:
        raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")
    args, run_dir = fixed_output_dir(argv)
    restart_args = [*without_option(args, "--resume"), "--resume", "auto"]
    child: subprocess.Popen | None = None
    stopping = False

    def forward_term(signum, frame) -> None:
        nonlocal stopping
        stopping = True
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, forward_term) if main_thread else None
    try:
        restarts = 0
        while True:
            command = [python, "-m", "honing.cli", "train", *(restart_args if restarts else args)]
            child = subprocess.Popen(command)
            if on_start is not None:
                on_start(child.pid)
            try:
                returncode = child.wait()
            except KeyboardInterrupt:  # Ctrl-C: the child got it too; let it finish
                stopping = True
                returncode = child.wait()
            if stopping or not is_crash(returncode) or restarts >= max_restarts:
                if is_crash(returncode) and not stopping:
                    log(f"training {_describe(returncode)}; no restarts left ({max_restarts})")
                return exit_status(returncode)
            restarts += 1
            log(
                f"training {_describe(returncode)}; restart {restarts} of {max_restarts} "
                "with --resume auto"
            )
            try:
                append_event(
                    run_dir,
                    "restart",
                    exit_status=exit_status(returncode),
                    reason=_describe(returncode),
                    restart=restarts,
                    max_restarts=max_restarts,
                )
            except (OSError, UserError) as err:  # a full disk: the restart matters more
                log(f"could not record the restart in {run_dir / EVENTS_FILE} ({err})")
            time.sleep(restart_delay_s)
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
