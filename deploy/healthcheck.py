"""The container image's HEALTHCHECK: ``GET /health`` of the ``honing serve`` service running
in the container, on the port and host its command line gives (``--port``, default 8080).

A container that runs no ``honing serve`` (``honing train``, ``honing doctor``) has no HTTP
endpoint and counts as healthy while it runs. Exit status 0: healthy, 1: not.
"""

from __future__ import annotations

import sys
import urllib.request
from pathlib import Path

DEFAULT_PORT = "8080"  # honing serve's --port default (honing/services/options.py)
HEALTH_PATH = "/health"  # answered by every honing serve service, without its token too


def _serve_command() -> list[str] | None:
    """The arguments after ``serve`` of the first ``honing serve`` process found."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if any(arg.endswith("honing") for arg in args) and "serve" in args:
            return args[args.index("serve") + 1 :]
    return None


def _option(args: list[str], flag: str, default: str) -> str:
    for index, arg in enumerate(args):
        if arg == flag and index + 1 < len(args):
            return args[index + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return default


def main() -> int:
    args = _serve_command()
    if args is None:
        return 0
    host = _option(args, "--host", "127.0.0.1")
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    port = _option(args, "--port", DEFAULT_PORT)
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}{HEALTH_PATH}"
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return 0 if answer.status == 200 else 1
    except OSError as err:
        print(f"{url}: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
