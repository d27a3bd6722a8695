"""Finding and killing every process of one sandboxed run (the sandbox and zygote sweeps).

A run's processes are found by uid (when honing is root each run or sandbox has a fresh uid)
or else by a per-run marker in their environment (best effort: a process that clears its
environment is not found; see ``sandbox`` for what that means for backend ``none``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time

log = logging.getLogger(__name__)

MARKER_ENV = "HONING_SANDBOX_RUN"
"""Environment variable whose value marks the processes of one run (or one zygote)."""


def count_processes(uid: int) -> int:
    """How many processes of ``uid`` this /proc shows."""
    count = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                count += entry.stat().st_uid == uid
    return count


def kill_everything(proc: subprocess.Popen, ids: tuple[int, int] | None, token: str) -> None:
    """SIGKILL the run's process group, then every process left of the run until none remain:
    when root, those of the run's fresh uid; otherwise those whose environment carries the
    run's marker (best effort: one that cleared its environment, as a non-root user without
    namespaces, is not found). With namespaces the PID namespace dies with its first process;
    the sweep waits for that to finish."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    needle = f"{MARKER_ENV}={token}".encode()
    for _round in range(200):
        found = [pid for pid in _live_pids() if _belongs(pid, ids, needle)]
        for pid in found:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        if not found:
            return
        time.sleep(0.005)
    log.warning("sandbox: processes of run %s survived the kill sweep", token)


def _live_pids() -> list[int]:
    return [int(entry.name) for entry in os.scandir("/proc") if entry.name.isdigit()]


def _belongs(pid: int, ids: tuple[int, int] | None, needle: bytes) -> bool:
    try:
        if ids:
            with open(f"/proc/{pid}/status", "rb") as handle:
                status = handle.read(2048).decode(errors="replace")
            fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
            alive = fields.get("State", "").split()[:1] not in (["Z"], ["X"])
            return alive and fields.get("Uid", "").split()[:1] == [str(ids[0])]
        with open(f"/proc/{pid}/environ", "rb") as handle:
            return needle in handle.read()
    except OSError:
        return False
