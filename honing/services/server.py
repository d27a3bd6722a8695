"""How honing's HTTP services are served: uvicorn's h11 protocol behind connection guards.

``honing serve ...`` (and the tests) start every service through ``server_config``, so they
all run under the same ``ServerLimits``:

- a connection that has not sent a complete request head ``header_timeout_s`` after it opened
  (or after the first byte of its next request) is closed, so slow or silent clients cannot
  hold sockets;
- at most ``max_connections`` are open at once; a connection past that is answered 503 and
  closed at once (a client that already sent its request may see a reset instead), so open
  files stay bounded and new requests are served again as soon as connections close;
- a keep-alive connection idle ``keep_alive_s`` between requests is closed;
- a request head over 16 KiB is refused with 400 (h11's limit); WebSocket upgrades are off.

Not guarded here: a client that sends its head in time and then its body slowly keeps its
connection until the app's own limits end the request.

The guards hold uvicorn's ``H11Protocol``, which is not public API: pyproject.toml bounds
uvicorn to the releases tested (``UVICORN_VERSIONS``), and this module checks, when it loads,
that the pieces it uses are there (``check_uvicorn``); a uvicorn without them is one line
naming the versions needed, before any port is taken or model loaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import inspect
import resource
import socket
from typing import Any

import h11
import uvicorn

from honing.errors import UserError
from honing.services.options import ServerLimits

try:  # private API: a release may move or drop it (check_uvicorn says so)
    from uvicorn.protocols.http.h11_impl import H11Protocol
except ImportError:
    H11Protocol = None
try:
    from uvicorn.server import ServerState
except ImportError:
    ServerState = None

UVICORN_VERSIONS = ">=0.29,<0.56"  # pyproject.toml's range: the releases these guards ran on
_PROTOCOL_METHODS = (
    "connection_made",
    "data_received",
    "eof_received",
    "connection_lost",
    "pause_writing",
    "resume_writing",
)
_PROTOCOL_ARGUMENTS = ("config", "server_state", "app_state", "_loop")

_SPARE_FILES = 256  # open files a service needs besides its connections (workers, models)
_BUSY_TEXT = b"too many connections; retry later\n"
_BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"connection: close\r\nretry-after: 1\r\n"
    b"content-length: " + str(len(_BUSY_TEXT)).encode() + b"\r\n\r\n" + _BUSY_TEXT
)


def check_uvicorn() -> None:
    """Checks that uvicorn has what ``GuardedConnection`` uses: ``H11Protocol``, built with
    ``(config, server_state, app_state, _loop)``, its protocol methods and the h11 connection
    its constructor keeps as ``conn``, and ``ServerState``'s ``connections``.

    Raises:
        UserError: one of them is missing, naming it and the uvicorn versions needed.
    """
    missing = _missing_from_uvicorn()
    if missing:
        raise UserError(
            f"honing's services need uvicorn{UVICORN_VERSIONS}: uvicorn {uvicorn.__version__} "
            f"lacks {missing}, a private API of uvicorn that honing.services.server builds "
            f"on; install 'uvicorn{UVICORN_VERSIONS}'"
        )


def _missing_from_uvicorn() -> str:
    if H11Protocol is None:
        return "H11Protocol"
    for method in _PROTOCOL_METHODS:  # its own, not asyncio.Protocol's that do nothing
        if getattr(H11Protocol, method, None) in (None, getattr(asyncio.Protocol, method, None)):
            return f"H11Protocol.{method}"
    arguments = inspect.signature(H11Protocol.__init__).parameters
    for argument in _PROTOCOL_ARGUMENTS:
        if argument not in arguments:
            return f"H11Protocol's argument {argument}"
    if "conn" not in H11Protocol.__init__.__code__.co_names:  # the attributes it sets
        return "H11Protocol.conn"
    if ServerState is None:
        return "ServerState"
    if not isinstance(getattr(ServerState(), "connections", None), set):
        return "ServerState.connections"
    return ""


check_uvicorn()


class GuardedConnection(asyncio.Protocol):
    """One connection: admitted under ``max_connections``, closed when its request head is not
    complete in time, otherwise served by uvicorn's ``H11Protocol`` (which it holds)."""

    def __init__(
        self,
        *,
        limits: ServerLimits,
        config: uvicorn.Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self.limits = limits
        self.http = H11Protocol(config, server_state, app_state, _loop)
        self.open_connections = server_state.connections  # the admitted ones, kept by uvicorn
        self.transport: asyncio.Transport | None = None
        self.admitted = False
        self.head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        if len(self.open_connections) >= self.limits.max_connections:
            transport.write(_BUSY)
            transport.close()
            return
        self.admitted = True
        self.http.connection_made(transport)
        self._start_head_deadline()

    def data_received(self, data: bytes) -> None:
        if not self.admitted:
            return
        if self.head_deadline is None and self._awaiting_head():
            self._start_head_deadline()
        self.http.data_received(data)
        if not self._awaiting_head():
            self._stop_head_deadline()

    def eof_received(self) -> bool | None:
        return self.http.eof_received() if self.admitted else None

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_deadline()
        if self.admitted:
            self.http.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.admitted:
            self.http.pause_writing()

    def resume_writing(self) -> None:
        if self.admitted:
            self.http.resume_writing()

    def _awaiting_head(self) -> bool:
        return self.http.conn.their_state is h11.IDLE

    def _start_head_deadline(self) -> None:
        self._stop_head_deadline()
        loop = asyncio.get_running_loop()
        self.head_deadline = loop.call_later(self.limits.header_timeout_s, self._head_expired)

    def _stop_head_deadline(self) -> None:
        if self.head_deadline is not None:
            self.head_deadline.cancel()
            self.head_deadline = None

    def _head_expired(self) -> None:
        self.head_deadline = None
        if self._awaiting_head() and self.transport is not None:
            self.transport.close()


def server_config(app: Any, limits: ServerLimits, *, log_level: str = "warning") -> uvicorn.Config:
    """The uvicorn settings of every honing service: ``app`` under ``limits``."""
    return uvicorn.Config(
        app,
        http=functools.partial(GuardedConnection, limits=limits),
        ws="none",
        lifespan="on",
        log_level=log_level,
        timeout_keep_alive=limits.keep_alive_s,
    )


def reserve_open_files(max_connections: int) -> None:
    """Raise this process's soft limit on open files, when it is too low for
    ``max_connections`` sockets and the files a service keeps besides, up to the hard limit.

    Raises:
        UserError: the hard limit is too low.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = max_connections + _SPARE_FILES
    if soft == resource.RLIM_INFINITY or needed <= soft:
        return
    if hard != resource.RLIM_INFINITY and needed > hard:
        raise UserError(
            f"--max-connections: {max_connections} connections need {needed} open files and "
            f"this process may open {hard} (ulimit -Hn); lower it or raise the limit"
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))


def listen(host: str, port: int) -> list[socket.socket]:
    """Sockets bound to every address of ``host`` at ``port`` (0: a free port, the same on
    every address), made before the app loads so that a taken port fails at once.

    Raises:
        UserError: ``host`` does not resolve, or the port is taken or not allowed.
    """
    try:
        found = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as exc:
        raise UserError(f"--host: cannot resolve {host!r} ({exc.strerror})") from None
    sockets: list[socket.socket] = []
    try:
        for family, address in dict.fromkeys((info[0], info[4]) for info in found):
            sock = socket.socket(family, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if len(sockets) > 1:  # port 0 picked a port on the first address: use it on all
                address = (address[0], sockets[0].getsockname()[1], *address[2:])
            sock.bind(address)
    except OSError as exc:
        for sock in sockets:
            sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise UserError(
                f"--port: {host}:{port} is already in use; choose another port (0: a free one)"
            ) from None
        if exc.errno == errno.EADDRNOTAVAIL:
            raise UserError(f"--host: {host} is not an address of this machine") from None
        raise UserError(f"--port: cannot listen on {host}:{port} ({exc.strerror})") from None
    return sockets


def serve(app: Any, sockets: list[socket.socket], limits: ServerLimits) -> None:
    """Serve ``app`` on ``sockets`` until Ctrl-C or SIGTERM, then shut down gracefully."""
    server = uvicorn.Server(server_config(app, limits))
    with contextlib.suppress(KeyboardInterrupt):
        server.run(sockets=sockets)
