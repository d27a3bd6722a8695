"""A command for ``test_warm``: ``main()`` does what its argv says, one word at a time."""

import os
import signal
import sys
import time


def main() -> int:
    for word in sys.argv[1:]:
        if word == "where":
            print(os.getcwd(), os.environ.get("PROBE"), os.getpid(), flush=True)
        elif word == "threads":
            print(sys.modules["torch"].get_num_threads(), flush=True)
        elif word == "shout":
            print("to stderr", file=sys.stderr)
        elif word == "trap":  # SIGTERM ends it with status 42
            signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(42))
        elif word == "sleep":  # in short naps: a signal another thread took (an OpenMP
            for _ in range(600):  # worker's) runs its handler at the next nap's end
                time.sleep(0.1)
        elif word.startswith("die="):
            os.kill(os.getpid(), int(word[4:]))
        elif word.startswith("exit="):
            return int(word[5:])
    return 0
