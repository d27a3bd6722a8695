"""One writer per run directory: ``RUN_DIR/.lock``, held with ``flock`` while a run writes.

Two runs into one ``--output-dir`` would both write ``config.yaml``, checkpoints and
``metrics.jsonl``, and one's history would be lost while both report success. So the process
that writes the run directory (the only process of a local run, rank 0 under torchrun, the
trainer actor under Ray, the child of ``--max-restarts``) takes an exclusive ``flock`` on
``RUN_DIR/.lock`` before it writes anything, and a second one is refused with one line naming
the holder (its pid, host and start time, which the file holds).

The kernel releases a ``flock`` when its process dies, however it dies, so the lock of a run
that crashed or was SIGKILLed is free at once: its leftover file is taken over (and reported).
A run that ends removes the file; a run refused or failed before it wrote anything also
removes the directories it made for the lock, so nothing is left half-written.

Limits: ``flock`` is advisory (only honing takes it) and, on NFS, rests on the server's lock
manager (NFSv4, or lockd for v3); a filesystem without working locks refuses nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import IO

from honing.errors import UserError

LOCK_FILE = ".lock"


class RunLock:
    """The exclusive lock on a run directory (``acquire``, then ``release``).

    Args:
        run_dir: The run directory; it and its missing parents are made by ``acquire``.
    """

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self._handle: IO[str] | None = None
        self._made: list[Path] = []  # directories made for the lock, outermost first

    def acquire(self) -> str | None:
        """Takes the lock, or raises.

        Returns:
            What the file said of a holder that died without releasing it (``None`` when
            there was none): the lock was free, the file a leftover.

        Raises:
            UserError: Another process holds the lock, or the directory cannot be made.
        """
        try:
            self._made = _make_dirs(self.run_dir)
            handle, leftover = self._take()
        except BaseException:
            self._remove_made()
            raise
        try:  # who holds it, for the message of a run refused
            handle.seek(0)
            handle.truncate()
            holder = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
            handle.write(json.dumps(holder) + "\n")
            handle.flush()
        except OSError:  # a full disk: the lock holds without the note
            pass
        self._handle = handle
        return leftover

    def _take(self) -> tuple[IO[str], str | None]:
        """Opens and locks the file; again when a releasing holder removed it meanwhile."""
        while True:
            try:
                handle = self.path.open("a+", encoding="utf-8")
            except OSError as err:
                raise UserError(
                    f"--output-dir {self.run_dir}: cannot write the run directory "
                    f"({err.strerror or err}); choose another --output-dir"
                ) from None
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(handle)
                handle.close()
                raise UserError(
                    f"--output-dir {self.run_dir} is being written by another honing train "
                    f"({holder}); wait for it to end, or choose another --output-dir"
                ) from None
            if _same_file(handle, self.path):
                handle.seek(0)
                return handle, handle.read().strip() or None
            handle.close()

    def release(self) -> None:
        """Removes the file and lets the lock go; then the directories made for it, if the
        run left them empty. Safe to call twice."""
        if self._handle is None:
            return
        with contextlib.suppress(OSError):
            self.path.unlink()  # while held: a process that opened it sees it gone, and retries
        self._handle.close()
        self._handle = None
        self._remove_made()

    def _remove_made(self) -> None:
        for directory in reversed(self._made):
            try:
                directory.rmdir()  # only when empty: what the run wrote stays
            except OSError:
                break
        self._made = []


def _make_dirs(run_dir: Path) -> list[Path]:
    """Makes ``run_dir`` and its missing parents; returns those it made, outermost first."""
    missing = []
    probe = Path(os.path.abspath(run_dir))
    while not probe.exists() and probe != probe.parent:
        missing.append(probe)
        probe = probe.parent
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(
            f"--output-dir {run_dir}: cannot make the run directory ({err.strerror or err}); "
            "choose another --output-dir"
        ) from None
    return list(reversed(missing))


def _same_file(handle: IO[str], path: Path) -> bool:
    """Whether ``path`` still names the file ``handle`` has open (a holder that released the
    lock removed it, and a new holder may have made another)."""
    try:
        named = os.stat(path)
    except FileNotFoundError:
        return False
    opened = os.fstat(handle.fileno())
    return (named.st_dev, named.st_ino) == (opened.st_dev, opened.st_ino)


def _holder(handle: IO[str]) -> str:
    """The holder's note as words: ``pid 12 on host-a since 2025-01-31 12:00:00``."""
    try:
        handle.seek(0)
        note = json.loads(handle.read())
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(note["since"]))
        return f"pid {note['pid']} on {note['host']} since {since}"
    except (OSError, ValueError, KeyError, TypeError):
        return "its note is unreadable"
