"""Run one untrusted program with limits, in the strongest isolation this machine offers.

Every run gets: its own session and process group; rlimits (CPU seconds, address space,
processes, file size, open files, no core dumps); a wall-clock deadline enforced from outside,
after which the whole group (and, with namespaces, the whole PID namespace) is killed, as it
also is after a normal exit, so no child outlives the run; stdout/stderr read incrementally and
capped (past the cap bytes are dropped and the result says so); a private working directory,
deleted afterwards; a minimal environment (``HOME`` is the working directory).

When honing runs as root, the program runs under a fresh random unprivileged uid/gid
(100000-1099999, no groups), so it cannot read or write root's files (mode permitting), cannot
signal or trace other processes, and ``RLIMIT_NPROC`` counts only its own processes: a fork
bomb stops at ``max_processes``. As a non-root user the program keeps that user's uid, so
``RLIMIT_NPROC`` counts all of the user's processes (the limit is raised by their current
count) and, without namespaces, the user's own files are readable and writable.

Backends (``backend=``), detected once by actually running ``true`` through each:

- ``bwrap`` (bubblewrap 0.5.0+, for ``--size``): new user, PID, network, IPC, UTS and mount
  namespaces; ``/`` bound read-only; private ``/proc`` and ``/dev`` (read-only, its device
  nodes usable); sized tmpfs over ``/tmp``, ``/var/tmp``, ``/dev/shm`` and ``$HOME``; the
  working directory a sized tmpfs too, the only other writable place; no network (loopback
  only, empty). An older bwrap, which cannot size a tmpfs (each would be half the machine's
  memory), is reported as not working, so ``auto`` passes over it. Not isolated: other
  read-only files the uid may read (e.g. world-readable files under ``/etc`` or the
  repository), CPU time beyond the rlimit, the kernel itself.
- ``unshare`` (util-linux): the same namespaces, every existing mount remounted read-only,
  sized tmpfs over ``/tmp``, ``/var/tmp``, ``/dev/shm`` and as the working directory, all
  capabilities dropped (``setpriv``). Not isolated: same as bwrap, and ``$HOME`` is read-only
  but visible.
- ``none``: rlimits, process group, uid switch when root, deadline. NOT isolated: network,
  the filesystem (readable where permissions allow; writable where the uid may write, e.g.
  ``/tmp``), other processes' visibility, and a child that calls ``setsid()`` and clears its
  environment escapes the final kill sweep. Nothing bounds what it writes but
  ``RLIMIT_FSIZE`` per file: the total (many files, in the host's own ``/tmp``, ``/dev/shm``
  or working directory) is unbounded, as capping it takes mounts it cannot make. A warning
  naming these is logged once.

Memory written to files: a tmpfs lives in the machine's memory (``Shmem`` in
``/proc/meminfo``) and not in the address space, so ``Limits.memory_bytes`` does not see it.
Each writable mount of bwrap and unshare is capped at ``Limits.tmpfs_bytes``; a run holds at
most five of them (bwrap: ``/tmp``, ``/var/tmp``, ``/dev/shm``, ``$HOME``, working directory;
unshare: four), 320 MiB with the default 64 MiB cap, beyond its address space, freed when it
ends. The files given to ``run_sandboxed`` count against the working directory's cap.

``auto`` picks the first that works of bwrap, unshare, none. No backend limits disk bandwidth,
memory in memfd files (``RLIMIT_FSIZE`` each, at most ``RLIMIT_NOFILE`` of them open) or in
SysV shared memory segments (none capped; freed with the IPC namespace after the run), or
kernel exploits; for hostile code at scale use a VM or gVisor.
"""

from __future__ import annotations

import logging
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from honing.sandbox.processes import MARKER_ENV, count_processes, kill_everything

log = logging.getLogger(__name__)

BACKENDS = ("bwrap", "unshare", "none")
_NONE_WARNING = (
    "sandbox backend 'none' (bwrap works: %s, unshare works: %s): programs run with rlimits, "
    "a process group and a deadline only. NOT isolated: network, filesystem (reads where "
    "permitted, writes where the uid may write), process visibility"
)
# Remount everything read-only, hide world-writable dirs under sized tmpfs ($1 bytes), and make
# the workdir one too, holding a copy of the host's (still our cwd).
_UNSHARE_SETUP = r"""
cd "$0" && size=$1 && shift || exit 97
for m in $(awk '{print $2}' /proc/self/mounts); do mount -o remount,bind,ro "$m" 2>/dev/null; done
for d in /tmp /var/tmp /dev/shm; do [ -d "$d" ] && mount -t tmpfs -o size="$size" none "$d"; done
mkdir -p "$0" && mount -t tmpfs -o size="$size" none "$0" && cp -a ./. "$0" || exit 97
cd "$0" && exec setpriv --bounding-set=-all --inh-caps=-all --no-new-privs -- "$@"
"""


@dataclass(frozen=True)
class Limits:
    """Resource limits of one run."""

    timeout_s: float = 5.0
    """Wall-clock deadline; the whole process tree is killed when it passes."""
    cpu_s: int | None = None
    """CPU seconds (RLIMIT_CPU); None means ``ceil(timeout_s) + 1``."""
    memory_bytes: int = 1 << 30
    """Address space (RLIMIT_AS). Python needs ~100+ MB of virtual memory just to start."""
    max_processes: int = 64
    """Processes of the run's uid (RLIMIT_NPROC); contains fork bombs."""
    max_file_bytes: int = 16 << 20
    """Largest file the program may write (RLIMIT_FSIZE)."""
    max_open_files: int = 256
    """Open file descriptors (RLIMIT_NOFILE)."""
    max_output_bytes: int = 1 << 20
    """Bytes kept of stdout and of stderr each; the rest is read and dropped."""
    tmpfs_bytes: int = 64 << 20
    """Size of each writable in-memory mount (bwrap, unshare: the working directory, ``/tmp``,
    ``/var/tmp``, ``/dev/shm``, bwrap's ``$HOME``), held in machine memory beyond
    ``memory_bytes`` (module docstring). A zygote sandbox sizes its mounts once, when it
    starts, with this default. Not applied by ``none``."""


@dataclass
class SandboxResult:
    """How one run ended. ``signal`` names the signal that ended it (e.g. "SIGKILL")."""

    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool
    wall_s: float
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    signal: str | None = None
    isolation: str = "none"
    channel: bytes = field(default=b"", repr=False)
    """What the run wrote to its side-channel pipe (zygote runs: the judge's lines), capped."""


def _run_quiet(argv: list[str], cwd: str, **kwargs) -> bool:
    try:
        done = subprocess.run(argv, cwd=cwd, capture_output=True, timeout=10, **kwargs)
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


@cache
def backend_works(backend: str) -> bool:
    """Whether ``backend`` can run a program here (tried once, under the run's uid)."""
    if backend == "none":
        return True
    if backend == "bwrap" and not _bwrap_sizes_tmpfs():
        return False
    workdir = Path(tempfile.mkdtemp(prefix="honing-probe-"))
    try:
        ids = _fresh_ids()
        if ids:
            os.chown(workdir, *ids)
        argv = _wrap(backend, ["true"], str(workdir))
        user = {"user": ids[0], "group": ids[1], "extra_groups": []} if ids else {}
        return _run_quiet(argv, str(workdir), **user)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


@cache
def detect_backend() -> str:
    """The best working backend (bwrap, then unshare, then none, warning once)."""
    for backend in ("bwrap", "unshare"):
        if backend_works(backend):
            return backend
    _warn_none_once()
    return "none"


def resolve_backend(backend: str = "auto") -> str:
    """``auto`` -> the detected one; a named backend must work here.

    Raises:
        ValueError: unknown name, or the named backend does not work on this machine.
    """
    if backend == "auto":
        return detect_backend()
    if backend not in BACKENDS:
        raise ValueError(f"unknown sandbox backend {backend!r}; expected auto or {BACKENDS}")
    if not backend_works(backend):
        raise ValueError(f"sandbox backend {backend!r} does not work on this machine")
    if backend == "none":
        _warn_none_once()
    return backend


@cache
def sandbox_python(backend: str = "auto") -> str:
    """A Python interpreter the sandboxed uid can run: this one if it can (a pyenv or venv
    under a private ``$HOME`` it cannot), else the system's ``python3``.

    Raises:
        RuntimeError: no interpreter runs inside the sandbox.
    """
    backend = resolve_backend(backend)
    candidates = [os.path.realpath(sys.executable), "/usr/bin/python3", "/usr/local/bin/python3"]
    for python in dict.fromkeys(candidates):
        if os.path.exists(python):
            probe = run_sandboxed([python, "-I", "-c", "pass"], backend=backend)
            if probe.returncode == 0:
                return python
    raise RuntimeError(f"no Python interpreter runs inside the {backend!r} sandbox")


@cache
def _bwrap_sizes_tmpfs() -> bool:
    """Whether the installed bwrap has ``--size`` (0.5.0+); warns when it is too old."""
    try:
        done = subprocess.run(["bwrap", "--help"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return False
    if "--size" in done.stdout:
        return True
    log.warning("bwrap lacks --size (needs 0.5.0+): its tmpfs mounts cannot be capped; not used")
    return False


@cache
def _warn_none_once() -> None:
    log.warning(_NONE_WARNING, backend_works("bwrap"), backend_works("unshare"))


def _fresh_ids() -> tuple[int, int] | None:
    """A random unprivileged uid/gid when root (its own NPROC count), else None (keep ours)."""
    if os.geteuid() != 0:
        return None
    uid = 100_000 + secrets.randbelow(1_000_000)
    return uid, uid


def _wrap(
    backend: str,
    argv: list[str],
    workdir: str,
    as_init: bool = False,
    tmpfs_bytes: int = Limits.tmpfs_bytes,
    file_fds: dict[str, int] | None = None,
) -> list[str]:
    """The command line that runs ``argv`` inside ``backend``, with cwd ``workdir``; with
    ``as_init`` (bwrap) ``argv`` is PID 1 of the namespace (unshare: always).

    The working directory inside is a fresh tmpfs of ``tmpfs_bytes``: unshare copies the host
    directory's files into it; bwrap starts it empty and writes each ``file_fds`` entry (name
    -> a readable descriptor the child inherits) into it."""
    if backend == "bwrap":
        hidden = ["/tmp", "/var/tmp", "/dev/shm"]
        home = os.path.expanduser("~")
        if home not in ("/", "") and os.path.isdir(home):
            hidden.append(home)
        size = ("--size", str(tmpfs_bytes))
        sized = [arg for path in (*hidden, workdir) for arg in (*size, "--tmpfs", path)]
        files = [
            arg
            for name, fd in (file_fds or {}).items()
            for arg in ("--file", str(fd), os.path.join(workdir, name))
        ]
        return [
            *("bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", *sized, *files),
            *("--remount-ro", "/dev", "--chdir", workdir, "--unshare-all"),
            *("--die-with-parent", "--new-session", *(["--as-pid-1"] if as_init else [])),
            *("--", *argv),
        ]
    if backend == "unshare":
        return [
            *("unshare", "--user", "--map-root-user", "--net", "--pid", "--ipc", "--uts"),
            *("--fork", "--kill-child", "--mount", "--mount-proc"),
            *("sh", "-c", _UNSHARE_SETUP, workdir, str(tmpfs_bytes), *argv),
        ]
    return list(argv)


def _limited(argv: list[str], limits: Limits, nproc: int) -> list[str]:
    """``argv`` under ``prlimit`` (hard = soft limits; cheaper than a preexec_fn fork)."""
    cpu_s = limits.cpu_s if limits.cpu_s is not None else int(limits.timeout_s) + 2
    return [
        *("prlimit", f"--cpu={cpu_s}", f"--as={limits.memory_bytes}", f"--nproc={nproc}"),
        *(f"--fsize={limits.max_file_bytes}", f"--nofile={limits.max_open_files}", "--core=0"),
        *("--", *argv),
    ]


class _Capture:
    """Bytes read from one pipe, keeping at most ``cap``."""

    def __init__(self, cap: int) -> None:
        self.cap, self.parts, self.size, self.truncated = cap, [], 0, False

    def add(self, data: bytes) -> None:
        room = self.cap - self.size
        if len(data) > room:
            self.truncated = True
            data = data[: max(room, 0)]
        self.parts.append(data)
        self.size += len(data)

    def text(self) -> str:
        return b"".join(self.parts).decode("utf-8", errors="replace")


def run_sandboxed(
    argv: list[str],
    *,
    stdin: bytes = b"",
    files: dict[str, str | bytes] | None = None,
    limits: Limits | None = None,
    backend: str = "auto",
) -> SandboxResult:
    """Run ``argv`` in a fresh private directory and return how it ended.

    Args:
        argv: the command (e.g. ``["python3", "-I", "main.py"]``), resolved on ``PATH``.
        stdin: bytes fed to the program's standard input.
        files: name -> content written into the working directory first (it counts against
            ``limits.tmpfs_bytes`` under bwrap and unshare).
        limits: resource limits (defaults: ``Limits()``).
        backend: ``auto``, ``bwrap``, ``unshare`` or ``none`` (module docstring).

    Raises:
        ValueError: unknown or unusable backend.
    """
    limits = limits or Limits()
    isolation = resolve_backend(backend)
    workdir = tempfile.mkdtemp(prefix="honing-sandbox-")
    file_fds: dict[str, int] = {}
    try:
        ids = _fresh_ids()
        for name, content in (files or {}).items():
            data = content.encode() if isinstance(content, str) else content
            Path(workdir, name).write_bytes(data)
            if isolation == "bwrap":
                file_fds[name] = os.open(os.path.join(workdir, name), os.O_RDONLY)
        if ids:
            for path in (workdir, *(os.path.join(workdir, name) for name in files or {})):
                os.chown(path, *ids)
        return _execute(argv, stdin, workdir, ids, limits, isolation, file_fds)
    finally:
        for fd in file_fds.values():
            os.close(fd)
        shutil.rmtree(workdir, onerror=_force_remove)


def _force_remove(function, path, _exc_info) -> None:
    """rmtree's error hook: make the parent writable (the program may have chmod-ed it)."""
    try:
        os.chmod(os.path.dirname(path), 0o700)
        function(path)
    except OSError:
        pass


def _execute(argv, stdin, workdir, ids, limits, isolation, file_fds) -> SandboxResult:
    token = secrets.token_hex(8)
    nproc = limits.max_processes + (0 if ids else count_processes(os.geteuid()))
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": workdir,
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        MARKER_ENV: token,
    }
    user = {"user": ids[0], "group": ids[1], "extra_groups": []} if ids else {}
    wrapped = _wrap(isolation, argv, workdir, tmpfs_bytes=limits.tmpfs_bytes, file_fds=file_fds)
    started = time.monotonic()
    try:
        proc = subprocess.Popen(
            _limited(wrapped, limits, nproc),
            cwd=workdir,
            pass_fds=tuple(file_fds.values()),
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            **user,
        )
    except OSError as exc:
        return SandboxResult(None, "", f"could not start: {exc}", False, 0.0, isolation=isolation)
    captures, timed_out = _pump(proc, stdin, limits, started)
    kill_everything(proc, ids, token)
    wall_s = time.monotonic() - started
    code = proc.returncode
    return SandboxResult(
        returncode=code,
        stdout=captures["stdout"].text(),
        stderr=captures["stderr"].text(),
        timed_out=timed_out,
        wall_s=wall_s,
        stdout_truncated=captures["stdout"].truncated,
        stderr_truncated=captures["stderr"].truncated,
        signal=signal.Signals(-code).name if code is not None and code < 0 else None,
        isolation=isolation,
    )


def _pump(proc, stdin: bytes, limits: Limits, started: float):
    """Feed stdin and read the outputs until the program has exited and its pipes are closed
    (or half a second after its exit, if strays still hold them), or until the deadline."""
    captures = {name: _Capture(limits.max_output_bytes) for name in ("stdout", "stderr")}
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ, "stdout")
    selector.register(proc.stderr, selectors.EVENT_READ, "stderr")
    pending = memoryview(stdin)
    if pending:
        os.set_blocking(proc.stdin.fileno(), False)
        selector.register(proc.stdin, selectors.EVENT_WRITE, "stdin")
    else:
        proc.stdin.close()
    pidfd = os.pidfd_open(proc.pid)
    selector.register(pidfd, selectors.EVENT_READ, "exit")
    limit, exited, readers = started + limits.timeout_s, False, 2
    try:
        while not (exited and readers == 0) and time.monotonic() < limit:
            for key, _ in selector.select(limit - time.monotonic()):
                if key.data == "exit":
                    selector.unregister(pidfd)
                    proc.wait()
                    exited, limit = True, min(limit, time.monotonic() + 0.5)
                elif key.data == "stdin":
                    pending = _feed(proc.stdin.fileno(), pending)
                    if not pending:
                        selector.unregister(proc.stdin)
                        proc.stdin.close()
                else:
                    data = os.read(key.fd, 65536)
                    if data:
                        captures[key.data].add(data)
                    else:
                        selector.unregister(key.fileobj)
                        readers -= 1
    finally:
        selector.close()
        os.close(pidfd)
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            stream.close()
    return captures, not exited


def _feed(fd: int, pending: memoryview) -> memoryview:
    """Write what the pipe ``fd`` (non-blocking) takes of ``pending``; the rest is returned."""
    try:
        return pending[os.write(fd, pending[:65536]) :]
    except BlockingIOError:
        return pending
    except BrokenPipeError:
        return pending[:0]
