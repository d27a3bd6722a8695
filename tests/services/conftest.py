"""Serve an app with uvicorn on a loopback port in a background thread."""

import socket
import threading
import time

import pytest
import uvicorn


class Served:
    """An app served by uvicorn on 127.0.0.1 in a background thread."""

    def __init__(self, app):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="error", lifespan="on"))
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
    served = []

    def start(app):
        served.append(Served(app))
        return served[-1].url

    yield start
    for item in served:
        item.close()
