"""Zygote pool: what one program leaves or does cannot reach the next program of the same
worker (files, processes, a killed or stopped zygote), the deadline holds from outside, and
no sandbox outlives ``close()``. Every backend that works here; one worker per pool, so
consecutive runs share a zygote."""

import json
import os
import signal
import struct
import threading
import time
import uuid

import pytest

from honing.rewards.code_verifier import CodeVerifier
from honing.sandbox.isolation import BACKENDS, Limits, backend_works
from honing.sandbox.zygote import GRACE_S, ZygotePool

from ._processes import processes_with

ROOT = os.geteuid() == 0
SHORT = Limits(timeout_s=1.0)
SQUARE = {"test_code": "def check(f):\n    assert f(3) == 9\n", "entry_point": "square"}
HONEST = {"response": "def square(x):\n    return x * x\n", "ground_truth": SQUARE}
backends = [
    pytest.param(b, marks=pytest.mark.skipif(not backend_works(b), reason=f"{b} unavailable"))
    for b in BACKENDS
]
PARENT_CHAIN = (
    "import os\ndef chain():\n    pid, found = os.getpid(), []\n    while pid > 1:\n"
    "        stat = open(f'/proc/{pid}/stat').read()\n"
    "        pid = int(stat.rsplit(')', 1)[1].split()[1])\n        found.append(pid)\n"
    "    return found\n"
)

# A SysV message queue and a key in the user keyring outlive the processes that made them.
KEYCTL = {"x86_64": (248, 250), "aarch64": (217, 219)}.get(os.uname().machine, (-1, -1))
IPC_KEY = int.from_bytes(os.urandom(3), "big") + 1  # SysV key, unique to this test session
IPC_PLANT = (
    f"import ctypes\nlibc = ctypes.CDLL(None)\nlibc.msgget({IPC_KEY}, 0o1600)\n"
    f"libc.syscall({KEYCTL[0]}, b'user', b'honing-left', b'x', 1, -4)\n"
)
IPC_LOOK = (
    f"__import__('ctypes').CDLL(None).msgget({IPC_KEY}, 0), "
    f"__import__('ctypes').CDLL(None).syscall({KEYCTL[1]}, 10, -4, b'user', b'honing-left', 0)"
)


def _main(pool: ZygotePool, program: str, limits: Limits = SHORT):
    """Run ``program`` as a stdio program (no stdin) on the pool."""
    frame = json.dumps({"program": program}).encode()
    return pool.run("main", struct.pack(">I", len(frame)) + frame, limits)


def _alive(pid: int) -> bool:
    """Running (a zombie is dead; reaping it is its parent's or init's business)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _descendants(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as handle:
            children = [int(word) for word in handle.read().split()]
    except OSError:
        return []
    return [pid for child in children for pid in (child, *_descendants(child))]


@pytest.mark.parametrize("backend", backends)
def test_next_program_finds_no_file_and_no_process_of_the_previous(backend):
    if backend == "none" and not ROOT:
        pytest.skip("backend none as a non-root user shares the host's /tmp (documented)")
    marker, name = f"honing-zygote-test-{uuid.uuid4().hex}", f"left-{uuid.uuid4().hex}"
    plant = (
        "import os, sys\n"
        f"for path in ('/tmp/{name}', '/dev/shm/{name}', '{name}', '../{name}'):\n"
        "    try:\n        open(path, 'w').write('x')\n    except OSError:\n        pass\n"
        + IPC_PLANT
        + "if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
        f"        os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(30)',"
        f" {marker!r}])\n    os._exit(0)\n"
        "import time\ntime.sleep(0.2)\nprint('planted', os.getcwd())"
    )
    look = (
        "import os\n"
        f"paths = ('/tmp/{name}', '/dev/shm/{name}', '../{name}')\n"
        "print(os.listdir('.'), [os.path.exists(p) for p in paths], " + IPC_LOOK + ")\n"
        "def cmdline(pid):  # a process may end between the listing and the read\n"
        "    try:\n        return open(f'/proc/{pid}/cmdline', 'rb').read()\n"
        "    except OSError:\n        return b''\n"
        f"print(sum(b'{marker}' in cmdline(p) for p in os.listdir('/proc') if p.isdigit()))"
    )
    pool = ZygotePool(backend, workers=1)
    try:
        first = _main(pool, plant)
        assert first.stdout.startswith("planted"), first
        assert processes_with(marker) == []
        second = _main(pool, look)
    finally:
        pool.close()
    assert second.stdout.split("\n")[:2] == ["[] [False, False, False] -1 -1", "0"], second
    assert not os.path.exists(f"/tmp/{name}") and not os.path.exists(first.stdout.split()[1])


@pytest.mark.parametrize("backend", backends)
def test_killing_the_zygote_fails_only_that_program(backend):
    killer = PARENT_CHAIN + (
        "for pid in chain():\n    try:\n        os.kill(pid, 9)\n    except OSError:\n"
        "        pass\ntry:\n    os.kill(-1, 9)\nexcept OSError:\n    pass\n"
        "def square(x):\n    return x * x\n"
    )
    items = [{"response": killer, "ground_truth": SQUARE}, HONEST]
    with CodeVerifier(workers=1, timeout_s=2.0, backend=backend) as verifier:
        results = verifier.score_batch(items)
    assert [r["verdict"] for r in results] == ["failed", "passed"], results


@pytest.mark.alone
@pytest.mark.parametrize("backend", backends)
def test_stopping_the_parents_times_out_and_the_worker_recovers(backend):
    stopper = PARENT_CHAIN + (
        "import signal\nfor pid in chain():\n    try:\n        os.kill(pid, signal.SIGSTOP)\n"
        "    except OSError:\n        pass\n"
        "def square(x):\n    return x * x\n"
    )
    with CodeVerifier(workers=1, timeout_s=0.5, backend=backend) as verifier:
        started = time.monotonic()
        stuck = verifier.score_batch([{"response": stopper, "ground_truth": SQUARE}])[0]
        elapsed = time.monotonic() - started
        honest = verifier.score_batch([HONEST])[0]
    assert stuck["verdict"] in ("timeout", "failed") and stuck["score"] == 0.0, stuck
    assert elapsed < 0.5 + 1.0 and honest["verdict"] == "passed"


@pytest.mark.alone
@pytest.mark.parametrize("backend", backends)
def test_a_stuck_zygote_is_killed_at_deadline_plus_grace(backend):
    pool = ZygotePool(backend, workers=1)
    try:
        assert _main(pool, "print('up')").stdout == "up\n"
        (sandbox,) = pool.pids()
        for pid in [sandbox, *_descendants(sandbox)]:
            os.kill(pid, signal.SIGSTOP)
        started = time.monotonic()
        stuck = _main(pool, "print('never')", Limits(timeout_s=0.5))
        elapsed = time.monotonic() - started
        assert stuck.timed_out and 0.5 + GRACE_S <= elapsed < 0.5 + GRACE_S + 0.5
        assert not _alive(sandbox)
        assert _main(pool, "print('again')").stdout == "again\n"
    finally:
        pool.close()


@pytest.mark.parametrize("backend", backends)
def test_sandbox_killed_mid_run_fails_that_run_and_restarts(backend):
    pool = ZygotePool(backend, workers=1)
    try:
        assert _main(pool, "print('up')").returncode == 0
        (sandbox,) = pool.pids()
        threading.Timer(0.3, os.killpg, (sandbox, signal.SIGKILL)).start()
        killed = _main(pool, "import time\ntime.sleep(5)", Limits(timeout_s=3.0))
        assert killed.returncode != 0 and not killed.timed_out
        assert _main(pool, "print('again')").stdout == "again\n"
    finally:
        pool.close()


@pytest.mark.parametrize("backend", backends)
def test_close_leaves_no_process(backend):
    pool = ZygotePool(backend, workers=2)
    threads = [threading.Thread(target=_main, args=(pool, "print(1)")) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    tree = [pid for sandbox in pool.pids() for pid in (sandbox, *_descendants(sandbox))]
    assert len(pool.pids()) == 2 and len(tree) >= 2
    pool.close()
    assert [pid for pid in tree if _alive(pid)] == []
    assert _main(pool, "print('lazy restart')").stdout == "lazy restart\n"
    pool.close()
