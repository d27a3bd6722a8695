"""Start ``honing serve ...`` as a process of its own on a free loopback port (tests,
benchmarks, and scripts that want a local verifier next to a run)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Sequence

import httpx

HONING = (sys.executable, "-m", "honing.cli")  # the command line of this interpreter's honing


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_service(
    *args: str, timeout_s: float = 60.0, honing: Sequence[str] = HONING
) -> tuple[subprocess.Popen, str]:
    """``honing serve ARGS --port P`` on a free port; returns the process and its base URL
    once ``/health`` answers. ``honing``: the argv that runs honing's command line.

    Raises:
        RuntimeError: the process exited (with its stderr) or did not answer in time.
    """
    port = free_port()
    command = [*honing, "serve", *args, "--port", str(port)]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    name = f"honing serve {' '.join(args)}"
    wait_healthy(process, url, timeout_s, name, lambda: process.stderr.read())
    return process, url


def wait_healthy(process: subprocess.Popen, url: str, timeout_s: float, name: str, output):
    """Returns once ``url``'s ``/health`` answers 200.

    Raises:
        RuntimeError: ``process`` exited (with what ``output()`` gives) or did not answer in
            ``timeout_s`` (it is killed).
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited: {output()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.1)
    process.kill()
    raise RuntimeError(f"{name} did not answer /health in {timeout_s} s")
