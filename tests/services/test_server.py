"""The connection guards every service runs under, against a real server on loopback."""

import selectors
import socket
import time

import httpx
import pytest

from honing.services.app import create_app
from honing.services.server import ServerLimits

pytestmark = pytest.mark.alone  # each test times the server's deadlines

_PARTIAL_HEAD = b"POST /score HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le"


class _Echo:
    def score_batch(self, items):
        return [{"score": 1.0} for _ in items]


def _stalled(url: str, count: int, head: bytes = _PARTIAL_HEAD) -> list[socket.socket]:
    """``count`` connections that each send ``head`` and then nothing."""
    port = int(url.rsplit(":", 1)[1])
    socks = []
    for _ in range(count):
        socks.append(socket.create_connection(("127.0.0.1", port), timeout=2))
        if head:
            socks[-1].sendall(head)
    return socks


def _closed_within(socks: list[socket.socket], seconds: float) -> list[socket.socket]:
    """Those of ``socks`` that the server closes within ``seconds`` (whatever it says first)."""
    closed = []
    with selectors.DefaultSelector() as selector:
        for sock in socks:
            selector.register(sock, selectors.EVENT_READ)
        deadline = time.monotonic() + seconds
        while len(closed) < len(socks) and (left := deadline - time.monotonic()) > 0:
            for key, _ in selector.select(left):
                try:
                    if key.fileobj.recv(4096):
                        continue
                except ConnectionResetError:
                    pass
                selector.unregister(key.fileobj)
                closed.append(key.fileobj)
    return closed


def _score_until_served(url: str, within_s: float) -> tuple[httpx.Response, float]:
    """POST /score, again on refusal (503 or a dropped connection), until it is served."""
    start = time.monotonic()
    while True:
        try:
            answer = httpx.post(f"{url}/score", json={"items": [{"response": "a"}]}, timeout=1)
            if answer.status_code != 503:
                return answer, time.monotonic() - start
        except httpx.TransportError:
            pass
        assert time.monotonic() - start < within_s, f"not served in {within_s} s"
        time.sleep(0.05)


def test_slow_heads_are_closed_and_requests_still_served(serve):
    limits = ServerLimits(header_timeout_s=1.0, max_connections=32)
    url = serve(create_app(_Echo(), service="t"), limits)
    stalled = _stalled(url, 200)
    try:
        opened = time.monotonic()
        refused = _closed_within(stalled, 0.5)
        assert len(refused) == 200 - 32  # past the cap: closed at once, not held
        answer, waited_s = _score_until_served(url, within_s=3.0)
        assert answer.status_code == 200
        assert answer.json()["results"] == [{"score": 1.0, "details": {}}]
        assert waited_s < 2.0  # served once the header timeout closed the admitted ones
        admitted = [sock for sock in stalled if sock not in refused]
        assert len(_closed_within(admitted, 2.0)) == 32
        assert time.monotonic() - opened < 3.0
    finally:
        for sock in stalled:
            sock.close()


def test_requests_are_served_while_slow_heads_hold_connections(serve):
    limits = ServerLimits(header_timeout_s=1.0, max_connections=256)
    url = serve(create_app(_Echo(), service="t"), limits)
    stalled = _stalled(url, 100)
    silent = _stalled(url, 1, head=b"")  # connects and never speaks
    try:
        opened = time.monotonic()
        assert _closed_within(stalled, 0.3) == []  # under the cap: held
        start = time.monotonic()
        assert httpx.get(f"{url}/health", timeout=2).status_code == 200
        assert time.monotonic() - start < 0.5  # served at once while they are held
        assert len(_closed_within(stalled + silent, 2.0)) == 101
        assert 0.8 < time.monotonic() - opened < 2.0  # by the 1 s header timeout
    finally:
        for sock in stalled + silent:
            sock.close()


def test_keep_alive_connections_are_closed_when_idle_or_slow(serve):
    limits = ServerLimits(header_timeout_s=1.0, keep_alive_s=0.5)
    url = serve(create_app(_Echo(), service="t"), limits)
    request = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    (idle,) = _stalled(url, 1, head=request)
    with idle:
        assert idle.recv(4096).startswith(b"HTTP/1.1 200")
        start = time.monotonic()
        assert _closed_within([idle], 2.0) == [idle]
        assert 0.3 < time.monotonic() - start < 1.5
    (slow,) = _stalled(url, 1, head=request)
    with slow:
        assert slow.recv(4096).startswith(b"HTTP/1.1 200")
        slow.sendall(b"GET /health HTTP/1.1\r\nHo")  # the next head starts, then stalls
        start = time.monotonic()
        assert _closed_within([slow], 3.0) == [slow]
        assert 0.7 < time.monotonic() - start < 2.0
