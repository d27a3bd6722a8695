"""Serve an app with uvicorn on a loopback port in a background thread, under the settings
``honing serve`` uses."""

import socket
import threading
import time

import pytest
import uvicorn

from honing.services.server import ServerLimits, server_config


class Served:
    """An app served by uvicorn on 127.0.0.1 in a background thread."""

    def __init__(self, app, limits: ServerLimits):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(server_config(app, limits, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]})
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.01)

    def close(self):
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


@pytest.fixture
def serve():
    """``serve(app, limits=None)`` -> its base URL; ``limits`` default to ``ServerLimits()``."""
    served = []

    def start(app, limits: ServerLimits | None = None):
        served.append(Served(app, limits or ServerLimits()))
        return served[-1].url

    yield start
    for item in served:
        item.close()
