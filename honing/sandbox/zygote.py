"""One long-lived sandbox per worker: a Python "zygote" that forks a fresh run per program.

Starting a sandbox (prlimit, bwrap/unshare, a Python with ``site``) costs 40-55 ms, more than
most programs take to test. So each worker keeps one zygote (``_zygote_server.py``), started
once with ``python -I`` (nothing imported from cwd or writable dirs) inside the worker's
sandbox (``sandbox`` module: bwrap, unshare or none), non-dumpable (``PR_SET_DUMPABLE 0``),
with the judge (``_judge.py``) loaded. Per program the host sends limits and four pipes
(stdin, stdout, stderr, channel); the zygote forks a run that takes the pipes, a fresh empty
directory, its rlimits (and, for ``none`` as root, a fresh random uid), and becomes the judge
(assert tests: the judge/candidate split of ``code_verifier``) or the program (stdio tests).
The zygote enforces the deadline and, after every run (exit or deadline), kills all of the
run's processes, deletes the run directory and empties the private scratch dirs. The host
enforces the deadline from outside too: no reply within deadline + ``GRACE_S`` kills the whole
sandbox (a new zygote starts for the next program) and the item is a timeout.

What consecutive programs of one worker share, and why that is safe:

- The zygote process. In bwrap/unshare it is PID 1 of the PID namespace: signals from inside
  the namespace that it has no handler for (SIGKILL, SIGSTOP included) are not delivered, so a
  program cannot stop or kill it; with ``none`` as root the run has another uid, so it cannot
  signal it either. It is non-dumpable and holds no capability a run keeps, so no run can
  ptrace it or open its ``/proc/<pid>/{mem,fd}``. Its memory is copied into each run by fork,
  but it never holds a program, tests, nonce or output: the run reads its stdin pipe after
  the fork and the host reads the outputs. If a program does kill it (``none`` as non-root),
  that program fails and a fresh zygote serves the next one.
- Processes: none survive a run. PID 1 ``kill(-1, SIGKILL)`` kills every other process of the
  namespace (no fork can race it); ``none`` as root: a helper with the run's uid does the same
  for that uid; ``none`` as non-root: the run's process group, then, level by level, every
  descendant (orphans re-parent to the zygote, a subreaper), all reaped.
- Files: the run directory (``HOME``, ``TMPDIR``, cwd) is deleted after every run; the
  private tmpfs ``/tmp``, ``/var/tmp``, ``/dev/shm`` (and bwrap's ``$HOME``) are emptied. With
  ``none`` as root only the run uid's entries at the top of the host's ``/tmp``, ``/var/tmp``,
  ``/dev/shm`` are removed (files it put elsewhere world-writable stay, unreadable to the next
  run's uid if their mode says so); as non-root nothing outside the run directory is cleaned.
- IPC objects and keys, which outlive processes: SysV shared memory, message queues and
  semaphore sets are removed after each run (namespaced: all in the private IPC namespace;
  ``none`` as root: the run uid's), POSIX message queues cannot be made (RLIMIT_MSGQUEUE 0),
  and the run uid's user keyrings are cleared (namespaced, and ``none`` as root: its uids
  serve later runs).
  Not cleaned for ``none`` as non-root (they would be the host user's own).
- The uid (bwrap/unshare): every run of a worker has the sandbox's uid (one fresh uid per
  zygote when root); harmless since nothing of the previous run is left to signal or trace.
- Kernel state outside the namespaces (e.g. page cache, CPU caches) is shared, as between any
  two processes on the machine.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import secrets
import selectors
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import weakref
from pathlib import Path

from honing.sandbox.isolation import (
    Limits,
    SandboxResult,
    _Capture,
    _feed,
    _fresh_ids,
    _wrap,
    resolve_backend,
    sandbox_python,
)
from honing.sandbox.processes import MARKER_ENV, kill_everything

GRACE_S = 0.5
"""How long past the deadline the host waits for the zygote's reply before killing it."""
_HERE = Path(__file__).parent
_LIVE_POOLS: weakref.WeakSet = weakref.WeakSet()


def _scratch_dirs(backend: str) -> list[str]:
    """Directories the zygote empties after each run (see the module docstring)."""
    dirs = ["/tmp", "/var/tmp", "/dev/shm"]
    home = os.path.expanduser("~")
    if backend == "bwrap" and home not in ("/", "") and os.path.isdir(home):
        dirs.append(home)
    if backend == "none" and os.geteuid() != 0:
        return []
    return dirs


class Zygote:
    """One worker's sandbox and the zygote inside it; started lazily, restarted after death."""

    def __init__(self, backend: str = "auto") -> None:
        self.backend = resolve_backend(backend)
        self._proc: subprocess.Popen | None = None
        self._control: socket.socket | None = None
        self._workroot = ""
        self._token = ""
        self._ids: tuple[int, int] | None = None

    @property
    def pid(self) -> int | None:
        """The host pid of the sandbox's first process (bwrap, unshare or the zygote)."""
        return self._proc.pid if self._proc else None

    def _start(self) -> None:
        namespaced = self.backend != "none"
        self._ids = _fresh_ids() if namespaced else None
        self._workroot = tempfile.mkdtemp(prefix="honing-zygote-")
        os.chmod(self._workroot, 0o711)
        if self._ids:
            os.chown(self._workroot, *self._ids)
        sweep = "init" if namespaced else ("uid" if os.geteuid() == 0 else "tree")
        config = {
            "workroot": self._workroot,
            "sweep": sweep,
            "scratch": _scratch_dirs(self.backend),
        }
        server = (_HERE / "_zygote_server.py").read_text()
        judge = (_HERE / "_judge.py").read_text()
        python = sandbox_python(self.backend)
        argv = [python, "-I", "-c", server, judge, json.dumps(config)]
        self._token = secrets.token_hex(8)
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": self._workroot,
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            MARKER_ENV: self._token,
        }
        host_end, zygote_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ids = self._ids
        user = {"user": ids[0], "group": ids[1], "extra_groups": []} if ids else {}
        with zygote_end:
            self._proc = subprocess.Popen(
                _wrap(self.backend, argv, self._workroot, as_init=True),
                cwd=self._workroot,
                env=env,
                stdin=zygote_end,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
                **user,
            )
        self._control = host_end
        host_end.settimeout(30.0)
        try:
            hello = host_end.recv(1 << 16)
        except OSError:
            hello = b""
        if not hello:
            self.close()
            raise RuntimeError(f"the {self.backend!r} zygote did not start")
        host_end.settimeout(None)

    def run(self, mode: str, stdin: bytes, limits: Limits) -> SandboxResult:
        """Run once: ``mode`` "judge" (assert tests; ``stdin`` holds the program and spec
        frames) or "main" (the program frame, then the program's stdin)."""
        cpu_s = limits.cpu_s if limits.cpu_s is not None else int(limits.timeout_s) + 2
        header = {
            "mode": mode,
            "timeout_s": limits.timeout_s,
            "cpu_s": cpu_s,
            "memory_bytes": limits.memory_bytes,
            "max_processes": limits.max_processes,
            "max_file_bytes": limits.max_file_bytes,
            "max_open_files": limits.max_open_files,
            "uid": None,
        }
        for attempt in range(2):
            if self._proc is None:
                self._start()
            if self.backend == "none" and os.geteuid() == 0:
                header["uid"] = _fresh_ids()[0]
            pipes = [os.pipe() for _ in range(4)]  # stdin, stdout, stderr, channel
            theirs = [pipes[0][0], *(write for _, write in pipes[1:])]
            ours = [pipes[0][1], *(read for read, _ in pipes[1:])]
            started = time.monotonic()
            try:
                socket.send_fds(self._control, [json.dumps(header).encode()], theirs)
            except OSError:
                for fd in theirs + ours:
                    os.close(fd)
                self.close()  # died while idle (e.g. its parent thread ended): start anew
                if attempt:
                    raise
                continue
            for fd in theirs:
                os.close(fd)
            return self._pump(ours, stdin, limits, started, header["uid"])
        raise AssertionError("unreachable")

    def _pump(self, fds, stdin: bytes, limits: Limits, started: float, uid) -> SandboxResult:
        """Feed stdin, read the outputs and the reply; past deadline + grace, kill the box."""
        captures = {name: _Capture(limits.max_output_bytes) for name in ("out", "err", "chan")}
        selector = selectors.DefaultSelector()
        for fd, name in zip(fds[1:], captures, strict=True):
            selector.register(fd, selectors.EVENT_READ, name)
        selector.register(self._control, selectors.EVENT_READ, "reply")
        pending = memoryview(stdin)
        os.set_blocking(fds[0], False)
        selector.register(fds[0], selectors.EVENT_WRITE, "stdin")
        limit, reply, readers = started + limits.timeout_s + GRACE_S, None, 3
        try:
            while not (reply is not None and readers == 0) and time.monotonic() < limit:
                for key, _ in selector.select(limit - time.monotonic()):
                    if key.data == "reply":
                        selector.unregister(self._control)
                        reply = self._control.recv(1 << 16)
                        reply = json.loads(reply) if reply else {"dead": True}
                        limit = min(limit, time.monotonic() + 0.2)  # strays holding a pipe
                    elif key.data == "stdin":
                        pending = _feed(fds[0], pending)
                        if not pending:
                            selector.unregister(fds[0])
                            os.close(fds[0])
                            fds[0] = -1
                    else:
                        data = os.read(key.fd, 65536)
                        captures[key.data].add(data)
                        if not data:
                            selector.unregister(key.fd)
                            readers -= 1
        finally:
            selector.close()
            for fd in fds:
                if fd >= 0:
                    os.close(fd)
        if reply is None or reply.get("dead"):
            self.close(uid, graceful=False)
        return self._result(reply, captures, started)

    def _result(self, reply, captures, started: float) -> SandboxResult:
        if reply is None:
            code, timed_out, note = None, True, ""
        elif reply.get("dead"):
            code, timed_out, note = None, False, "the sandbox died during the run\n"
        else:
            code, timed_out = reply.get("returncode"), bool(reply.get("timed_out"))
            note = f"zygote: {reply['error']}\n" if reply.get("error") else ""
        return SandboxResult(
            returncode=code,
            stdout=captures["out"].text(),
            stderr=captures["err"].text() + note,
            timed_out=timed_out,
            wall_s=time.monotonic() - started,
            stdout_truncated=captures["out"].truncated,
            stderr_truncated=captures["err"].truncated,
            signal=signal.Signals(-code).name if code is not None and code < 0 else None,
            isolation=self.backend,
            channel=b"".join(captures["chan"].parts),
        )

    def close(self, run_uid: int | None = None, graceful: bool = True) -> None:
        """End the sandbox and everything in it (a later ``run`` starts a new one).

        ``graceful``: first let the zygote exit on its own (it does when the host closes the
        socket), so its own parent reaps it; then kill whatever is left either way."""
        proc, self._proc = self._proc, None
        if self._control is not None:
            self._control.close()
            self._control = None
        if proc is not None:
            if graceful:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=1.0)
            ids = self._ids or ((run_uid, run_uid) if run_uid is not None else None)
            kill_everything(proc, ids, self._token)
        if self._workroot:
            shutil.rmtree(self._workroot, ignore_errors=True)
            self._workroot = ""


class ZygotePool:
    """``workers`` zygotes of one backend; ``run`` borrows an idle one (blocking if none).

    Zygotes start on first use and are killed by ``close()`` and at interpreter exit.
    """

    def __init__(self, backend: str = "auto", workers: int | None = None) -> None:
        self.backend = resolve_backend(backend)
        self._zygotes = [Zygote(self.backend) for _ in range(workers or os.cpu_count() or 1)]
        self._idle = list(self._zygotes)
        self._ready = threading.Condition()
        _LIVE_POOLS.add(self)

    def run(self, mode: str, stdin: bytes, limits: Limits) -> SandboxResult:
        """``Zygote.run`` on an idle zygote of the pool."""
        with self._ready:
            self._ready.wait_for(lambda: self._idle)
            zygote = self._idle.pop()
        try:
            return zygote.run(mode, stdin, limits)
        finally:
            with self._ready:
                self._idle.append(zygote)
                self._ready.notify()

    def pids(self) -> list[int]:
        """Host pids of the running sandboxes (for tests and monitoring)."""
        return [zygote.pid for zygote in self._zygotes if zygote.pid is not None]

    def close(self) -> None:
        for zygote in self._zygotes:
            with contextlib.suppress(OSError):
                zygote.close()


@atexit.register
def _close_all() -> None:
    for pool in list(_LIVE_POOLS):
        pool.close()
