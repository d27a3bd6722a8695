"""The client of ``tests/warm.py``'s server: ``python -S warm_client.py SOCKET MODULE ARGS``
runs like ``python -m MODULE ARGS``. It hands the server its argv, environment, working
directory and stdin/stdout/stderr, passes the signals it gets on to the forked command, and
exits with its status (or dies of its signal). Standard library only, no site: it starts in
a few milliseconds."""

import contextlib
import json
import os
import signal
import socket
import sys

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def main() -> None:
    path, module, *args = sys.argv[1:]
    # held until the command's pid is known, then passed on: none is lost or kills us first
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    for fd in (0, 1, 2):  # a closed one would be taken by the socket and handed on as the
        try:  # command's own
            os.fstat(fd)
        except OSError:
            os.open(os.devnull, os.O_RDWR)  # the lowest free descriptor: this one
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    request = {"module": module, "args": args, "cwd": os.getcwd(), "env": dict(os.environ)}
    socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], [0, 1, 2])
    replies = conn.makefile("rb")
    line = replies.readline()
    if not line:  # the keeper died before starting it
        sys.exit(70)
    pid = json.loads(line)["pid"]

    def forward(signum, frame):
        with contextlib.suppress(ProcessLookupError):  # it has just ended: its status follows
            os.kill(pid, signum)

    for signum in FORWARDED:
        signal.signal(signum, forward)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
    line = replies.readline()
    if not line:  # the keeper died: the command with it
        sys.exit(70)
    status = json.loads(line)["status"]
    if status < 0:  # the command died of a signal: so does its stand-in
        with contextlib.suppress(OSError, ValueError):  # SIGKILL keeps its default
            signal.signal(-status, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [-status])
        os.kill(os.getpid(), -status)
    sys.exit(status)


if __name__ == "__main__":
    main()
