"""``python -m honing.cli`` and ``torchrun`` for tests that run many: the commands start in
a process forked from a warm interpreter instead of importing torch and transformers afresh.

A fresh ``python -m honing.cli train`` spends ~4.5 CPU-s on its imports before it does
anything; over the suite's runs, that was most of its CPU. Each test process (pytest or an
xdist worker) starts one server that has imported them. ``command(module, *args)`` is an argv
that runs like ``python -m module args``: a small client (``warm_client.py``, standard library
only) hands the server its argv, environment, working directory and stdin/stdout/stderr; the
server forks the command with them. The client stands for the command: it exits with the
command's status (or dies of its signal) and passes on the signals it gets; a client that is
killed takes the command with it, a moment after. So ``subprocess.run``, ``Popen`` and
``torchrun --no-python`` (its ranks started through clients) behave as they do with the real
interpreter, at a fraction of the CPU.

What a fork cannot show, tests check with the real interpreter: a command's own imports
(``test_cli``), one under ``unshare`` and the CPU time of a run (``test_cli_bad_input``),
signals to the process itself (``test_cli_signals``), a killed server whose port is closed
once it is reaped (``test_openai_engine``), ``torchrun -m honing.cli`` itself and a killed
rank (``test_data_parallel_run``, ``test_sharded_run``).
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLIENT = Path(__file__).with_name("warm_client.py")

# What a training run and torchrun's launcher import, loaded once in the server.
PRELOAD = (
    "honing.cli",
    "honing.backends.launch",
    "honing.pipeline.components",
    "honing.pipeline.run",
    "honing.models.loading",
    "transformers.models.llama.modeling_llama",
    "torch.distributed.run",
)


def command(module: str, *args: object) -> list[str]:
    """An argv that runs like ``python -m MODULE ARGS`` (from a fork of the warm server)."""
    return [sys.executable, "-S", str(CLIENT), _socket(), module, *map(str, args)]


def honing(*args: object) -> list[str]:
    """``python -m honing.cli ARGS``, warm."""
    return command("honing.cli", *args)


def launcher(ranks: int) -> list[str]:
    """``torchrun --standalone --nproc_per_node RANKS``, warm; the rank command follows."""
    return command("torch.distributed.run", "--nproc_per_node", ranks, "--standalone")


def torchrun(ranks: int, *args: object) -> list[str]:
    """``torchrun --standalone --nproc_per_node RANKS -m honing.cli ARGS``, warm: the launcher
    and each rank are forks of the server."""
    return [*launcher(ranks), "--no-python", *honing(*args)]


# The server's environment, as it was when the suite started (not a test's monkeypatched one):
# what the modules read as they are imported comes from it. A command's own environment is
# the client's; of what is read at import, only OMP_NUM_THREADS (torchrun's 1 per rank) is
# applied again in the command.
_ENV = dict(os.environ)
_lock = threading.Lock()
_server: subprocess.Popen | None = None
_path: str | None = None


def _socket() -> str:
    """The server's socket, starting the server on first use."""
    global _server, _path
    with _lock:
        if _server is None or _server.poll() is not None:
            # a short path: a Unix socket's is at most 107 bytes, whatever TMPDIR is
            _path = os.path.join(tempfile.mkdtemp(prefix="honing-warm-", dir=_short_tmp()), "s")
            # the server ends when this process does: its stdin, our pipe, closes
            _server = subprocess.Popen(
                [sys.executable, "-c", "from tests import warm; warm.serve()", _path],
                cwd=ROOT,
                env=_ENV,
                stdin=subprocess.PIPE,
            )
            atexit.register(_stop, _server)
        deadline = time.monotonic() + 120
        while not os.path.exists(_path):
            if _server.poll() is not None:
                raise RuntimeError(f"the warm server exited with status {_server.returncode}")
            if time.monotonic() > deadline:
                raise RuntimeError("the warm server did not listen within 120 s")
            time.sleep(0.01)
        return _path


def _short_tmp() -> str | None:
    default = tempfile.gettempdir()
    return default if len(default) < 64 or not os.path.isdir("/tmp") else "/tmp"


def _stop(server: subprocess.Popen) -> None:
    server.stdin.close()  # the server removes its socket and ends
    try:
        server.wait(timeout=10)
    except subprocess.TimeoutExpired:
        server.kill()


def serve() -> None:
    """The server (``python -c`` with the socket's path, then the modules to import if not
    ``PRELOAD``): imports them, then for each client forks a keeper, which forks the command
    and watches both."""
    path, *preload = sys.argv[1:]
    for name in preload or PRELOAD:
        importlib.import_module(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".new")
    listener.listen(64)
    os.rename(path + ".new", path)  # clients connect once it listens
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # keepers are reaped as they end
    while True:
        ready, _, _ = select.select([listener, sys.stdin], [], [])
        if sys.stdin in ready:  # the test process has ended (or closed our pipe)
            os.unlink(path)
            os.rmdir(os.path.dirname(path))
            return
        conn, _ = listener.accept()
        if os.fork() == 0:
            listener.close()
            _keep(conn)  # never returns
        conn.close()


def _keep(conn: socket.socket) -> None:
    """The keeper of one command: starts it with the client's request and descriptors, tells
    the client its pid and, at the end, its status; a client that goes away kills it."""
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        request, fds = _receive(conn)
        pid = os.fork()
        if pid == 0:
            conn.close()
            _command(request, fds)  # never returns
        for fd in fds:
            os.close(fd)
        conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        code = _watch(conn, pid)
        conn.sendall(json.dumps({"status": code}).encode() + b"\n")
    except OSError:
        pass  # the client went away while we told it
    finally:
        os._exit(0)


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds = b"", []
    while not data.endswith(b"\n"):
        chunk, more, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        if not chunk:
            raise OSError("the client closed before its request")
        data, fds = data + chunk, fds + list(more)
    return json.loads(data), fds


def _watch(conn: socket.socket, pid: int) -> int:
    """Waits for the command; until it ends, a closed connection (the client died) kills it."""
    try:
        process = os.pidfd_open(pid)
    except (AttributeError, OSError):  # no pidfds (Linux < 5.3): look 20 times a second
        process = None
    watched = [conn]
    while True:
        ready = select.select(watched if process is None else [process, *watched], [], [], 0.05)[0]
        if process is None:
            ended, status = os.waitpid(pid, os.WNOHANG)
            if ended:
                return os.waitstatus_to_exitcode(status)
        elif process in ready:
            os.close(process)
            return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        if conn in ready:  # the client sends nothing: readable means it is gone
            os.kill(pid, signal.SIGKILL)
            watched = []


def _command(request: dict, fds: list[int]) -> None:
    """The forked command: the client's descriptors as 0, 1, 2, its working directory,
    environment and argv, then its module's ``main()`` (what ``python -m`` of each module
    here runs); it ends as an interpreter does. Its signal handlers are an interpreter's
    (SIGCHLD back to the default in the keeper)."""
    code = 1
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the process's own
        sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", closefd=False, errors="backslashreplace", buffering=1)  # noqa: SIM115
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        _threads(os.environ.get("OMP_NUM_THREADS"))
        sys.argv = [request["module"], *request["args"]]
        code = importlib.import_module(request["module"]).main() or 0  # what its __main__ does
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (stop.code is not None)
        if isinstance(stop.code, str):
            print(stop.code, file=sys.stderr)
    except BaseException as error:  # noqa: BLE001 - printed as an uncaught error would be
        import traceback

        traceback.print_exc()
        # an interpreter dies of the SIGINT it did not handle
        code = -signal.SIGINT if isinstance(error, KeyboardInterrupt) else 1
    finally:
        try:
            threading._shutdown()  # the interpreter's end: non-daemon threads, atexit
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            if code == -signal.SIGINT:
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGINT)
            os._exit(int(code) & 0xFF)


def _threads(value: str | None) -> None:
    """OMP_NUM_THREADS as torch read it when imported, here where it was imported before."""
    try:
        threads = int(value or "")
    except ValueError:
        return
    if threads > 0 and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads)


def start_service(*args: str, **kwargs) -> tuple[subprocess.Popen, str]:
    """``honing.services.process.start_service``, warm."""
    from honing.services import process

    return process.start_service(*args, honing=honing(), **kwargs)
