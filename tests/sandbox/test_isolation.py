"""Sandbox: plain runs, limits, and the adversarial suite on every backend that works here.

Each adversarial program carries a unique marker in its command line; after the run no process
with that marker may survive (scanned in /proc), and nothing outside its directory may change.
"""

import json
import os
import shlex
import shutil
import socket
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from honing.sandbox.isolation import (
    BACKENDS,
    Limits,
    _bwrap_sizes_tmpfs,
    backend_works,
    resolve_backend,
    run_sandboxed,
    sandbox_python,
)

from ._processes import processes_with

SHORT = Limits(timeout_s=1.0, max_output_bytes=64 << 10)
ROOT = os.geteuid() == 0
backends = [
    pytest.param(b, marks=pytest.mark.skipif(not backend_works(b), reason=f"{b} unavailable"))
    for b in BACKENDS
]
namespaced = [p for p in backends if p.values[0] != "none"]


def _run(backend: str, code: str, limits: Limits = SHORT, **kwargs):
    """Run ``code`` with a fresh marker comment; returns (result, marker)."""
    marker = f"honing-test-{uuid.uuid4().hex}"
    python = sandbox_python(backend)
    result = run_sandboxed(
        [python, "-c", f"# {marker}\n{code}"], limits=limits, backend=backend, **kwargs
    )
    return result, marker


def _shmem_bytes() -> int:
    """The machine's shared memory (tmpfs pages included), from ``/proc/meminfo``."""
    with open("/proc/meminfo") as handle:
        for line in handle:
            if line.startswith("Shmem:"):
                return int(line.split()[1]) << 10
    raise AssertionError("no Shmem line in /proc/meminfo")


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="unknown sandbox backend"):
        resolve_backend("docker")


@pytest.mark.parametrize(
    ("help_text", "works"), [("--tmpfs DEST\n--size BYTES", True), ("--tmpfs DEST", False)]
)
def test_bwrap_without_size_is_not_used(help_text, works, monkeypatch, caplog):
    """A bwrap that runs but has no ``--size`` (before 0.5.0) is reported as not working."""
    stand_in = tempfile.mkdtemp(prefix="honing-test-bwrap-")
    os.chmod(stand_in, 0o755)  # the probe may run under a fresh uid
    script = Path(stand_in, "bwrap")
    script.write_text(f'#!/bin/sh\n[ "$1" = --help ] && echo {shlex.quote(help_text)}\nexit 0\n')
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{stand_in}:{os.environ['PATH']}")
    _bwrap_sizes_tmpfs.cache_clear()
    try:
        assert backend_works.__wrapped__("bwrap") is works
    finally:
        _bwrap_sizes_tmpfs.cache_clear()
        shutil.rmtree(stand_in)
    assert ("lacks --size" in caplog.text) is not works


@pytest.mark.parametrize("backend", backends)
def test_plain_run_stdin_files_and_private_dir(backend):
    code = "import os, sys\nprint(sys.stdin.read().upper(), open('data.txt').read(), os.getcwd())"
    result, _ = _run(backend, code, stdin=b"hello", files={"data.txt": "x"})
    words = result.stdout.split()
    assert result.returncode == 0 and words[:2] == ["HELLO", "x"], result
    assert result.isolation == backend and not result.timed_out
    assert not os.path.exists(words[2])


@pytest.mark.alone
@pytest.mark.parametrize("backend", backends)
def test_infinite_loop_is_killed_at_the_deadline(backend):
    started = time.monotonic()
    result, marker = _run(backend, "while True:\n    pass")
    assert result.timed_out and time.monotonic() - started < 3.0
    assert processes_with(marker) == []


@pytest.mark.parametrize("backend", backends)
def test_fork_bomb_is_contained(backend):
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    result, marker = _run(backend, code, limits=Limits(timeout_s=1.0, max_processes=32))
    assert result.timed_out
    assert processes_with(marker) == []


@pytest.mark.parametrize("backend", backends)
def test_memory_bomb_fails(backend):
    code = "blocks = []\nwhile True:\n    blocks.append(b'x' * (64 << 20))"
    result, marker = _run(backend, code, limits=Limits(timeout_s=5.0, memory_bytes=512 << 20))
    assert result.returncode != 0 and "MemoryError" in result.stderr
    assert processes_with(marker) == []


@pytest.mark.parametrize("backend", backends)
def test_endless_output_is_capped(backend):
    result, marker = _run(backend, "while True:\n    print('y' * 1000)")
    assert result.stdout_truncated and len(result.stdout) <= SHORT.max_output_bytes
    assert processes_with(marker) == []


@pytest.mark.parametrize("backend", backends)
def test_huge_file_is_stopped(backend):
    code = "f = open('big', 'wb')\nwhile True:\n    f.write(b'z' * (1 << 20))"
    result, _ = _run(backend, code, limits=Limits(timeout_s=2.0, max_file_bytes=4 << 20))
    assert result.returncode != 0 and not result.timed_out
    assert result.signal == "SIGXFSZ" or "File too large" in result.stderr


@pytest.mark.parametrize("backend", backends)
def test_child_outliving_its_parent_is_killed(backend):
    code = (
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
        "        time.sleep(30)\n    os._exit(0)\nprint('parent done')"
    )
    result, marker = _run(backend, code)
    assert result.returncode == 0 and "parent done" in result.stdout
    time.sleep(0.1)
    assert processes_with(marker) == []


@pytest.mark.parametrize("backend", backends)
def test_killing_the_parent_harms_only_the_run(backend):
    code = "import os, signal\nos.killpg(os.getpgid(0), signal.SIGKILL)\nos.kill(os.getppid(), 9)"
    result, marker = _run(backend, code)
    assert result.returncode != 0 or result.signal
    assert processes_with(marker) == []


@pytest.mark.parametrize("backend", backends)
def test_files_outside_the_directory_are_untouched(backend, tmp_path):
    if backend == "none" and not ROOT:
        pytest.skip("backend none as a non-root user: the user's own files are writable")
    keep = tmp_path / "keep.txt"
    keep.write_text("precious")
    escape = f"/tmp/honing-escape-{uuid.uuid4().hex}"
    code = (
        f"import os\nfor action in (lambda: os.remove({str(keep)!r}),\n"
        f"               lambda: open({escape!r}, 'w').write('x'),\n"
        f"               lambda: open({str(keep)!r}, 'w').write('gone')):\n"
        "    try:\n        action()\n        print('did')\n    except OSError as e:\n"
        "        print('blocked', e)"
    )
    result, _ = _run(backend, code)
    assert keep.read_text() == "precious" and result.stdout.count("blocked") >= 2, result.stdout
    if backend == "none":  # world-writable /tmp stays writable without a mount namespace
        os.path.exists(escape) and os.remove(escape)
    else:  # the write landed in the sandbox's private /tmp, gone with it
        assert not os.path.exists(escape)


@pytest.mark.parametrize("backend", backends)
def test_secrets_outside_the_directory_are_unreadable(backend, tmp_path):
    if backend == "none" and not ROOT:
        pytest.skip("backend none as a non-root user: the user's own files are readable")
    secret = tmp_path / ".ssh" / "id_fake"
    secret.parent.mkdir()
    secret.write_text("SECRET-KEY-MATERIAL")
    secret.chmod(0o600)
    home_secret = os.path.expanduser(f"~/.honing-test-secret-{uuid.uuid4().hex}")
    code = (
        f"for path in ({str(secret)!r}, {home_secret!r}):\n    try:\n"
        "        print(open(path).read())\n    except OSError as e:\n        print('blocked')"
    )
    with open(home_secret, "w") as handle:
        handle.write("SECRET-KEY-MATERIAL")
    os.chmod(home_secret, 0o600)
    try:
        result, _ = _run(backend, code)
    finally:
        os.remove(home_secret)
    assert "SECRET" not in result.stdout and result.stdout.count("blocked") == 2


@pytest.mark.parametrize("backend", namespaced)
def test_network_is_unreachable(backend):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.2)
    port = server.getsockname()[1]
    code = (
        f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
        "    print('connected')\nexcept OSError as e:\n    print('blocked', e)"
    )
    try:
        result, _ = _run(backend, code)
        with pytest.raises(TimeoutError):
            server.accept()
    finally:
        server.close()
    assert "blocked" in result.stdout and "connected" not in result.stdout


FLOOD = """
import json, os, time
totals = {}
for place in places:
    written, error = 0, None
    try:
        for index in range(8):
            fd = os.open(os.path.join(place, f"flood-{index}"), os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                for _ in range(16):
                    written += os.write(fd, b"f" * (1 << 20))
            finally:
                os.close(fd)
    except OSError as e:
        error = e.strerror
    totals[place] = [written, error]
print(json.dumps(totals), flush=True)
time.sleep(0.5)
"""
"""Writes 8 files of 16 MiB into each of ``places`` (until an error), reports what it wrote
per place, then holds the files half a second."""


@pytest.mark.alone
@pytest.mark.parametrize("backend", namespaced)
def test_in_memory_file_systems_are_capped(backend):
    """Flooding every writable place stops at ``tmpfs_bytes`` each, and the machine's Shmem,
    sampled while the program holds what it wrote, rises by at most five mounts' worth."""
    cap = 8 << 20
    home = os.path.expanduser("~")
    places = ["/tmp", "/var/tmp", "/dev/shm", "/dev", home, "."]
    code = f"places = {places!r}\n{FLOOD}"
    before = peak = _shmem_bytes()
    running = threading.Event()
    running.set()

    def sample() -> None:
        nonlocal peak
        while running.is_set():
            peak = max(peak, _shmem_bytes())
            time.sleep(0.01)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        result, _ = _run(backend, code, limits=Limits(timeout_s=10.0, tmpfs_bytes=cap))
    finally:
        running.clear()
        sampler.join()
    totals = json.loads(result.stdout)
    rise, held = peak - before, sum(written for written, _ in totals.values())
    # At least half of what it held: the samples saw its files, so the upper bound means something.
    assert held // 2 <= rise <= 5 * cap + (48 << 20), (rise, totals)
    for place, (written, error) in totals.items():
        assert written <= cap and error, (place, written, error)
