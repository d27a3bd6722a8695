"""A real S3 API on loopback, for the tests and benchmarks: moto's server mode
(``python -m moto.server``), reached through the standard AWS environment variables."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from contextlib import contextmanager

from honing.services.process import free_port


class S3Server:
    """One moto server process; ``env`` holds the AWS variables that point clients at it."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)]
        self.process = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                break
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto's S3 server did not start on {self.url}") from None
                time.sleep(0.1)
        self.env = {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": self.url,
            "AWS_MAX_ATTEMPTS": "1",  # botocore's own retries off: a dead endpoint fails fast
        }

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()


@contextmanager
def s3_server():
    server = S3Server()
    try:
        yield server
    finally:
        server.kill()
