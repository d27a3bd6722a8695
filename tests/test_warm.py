"""``tests/warm.py``: a command forked from the warm server behaves as the process it stands
for, as the tests that use it assume."""

import os
import signal
import subprocess
import sys
import time

import pytest

from tests import warm


def probe(*words: str) -> list[str]:
    return warm.command("tests._warm_probe", *words)


def test_a_command_has_the_callers_directory_environment_output_and_status(tmp_path):
    env = os.environ | {"PROBE": "seen"}
    result = subprocess.run(
        probe("where", "shout", "exit=3"), cwd=tmp_path, env=env, capture_output=True, text=True
    )
    cwd, value, pid = result.stdout.split()
    assert (cwd, value, result.stderr, result.returncode) == (
        str(tmp_path),
        "seen",
        "to stderr\n",
        3,
    )
    assert int(pid) != os.getpid()


def _started(*words: str) -> tuple[subprocess.Popen, int]:
    """The probe running ``words``, once it has said where it is (``where`` among them)."""
    client = subprocess.Popen(probe(*words), stdout=subprocess.PIPE, text=True)
    return client, int(client.stdout.readline().split()[2])


def _gone(pid: int, within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.01)
    return False


@pytest.mark.alone  # a 10 s deadline: a neighbour loading both cores once outlasted it
def test_a_signal_to_the_client_reaches_the_command_and_is_its_status():
    client, pid = _started("trap", "where", "sleep")  # the command's handler: it exits 42
    client.send_signal(signal.SIGTERM)
    assert client.wait(timeout=10) == 42
    client, pid = _started(
        "where", "sleep"
    )  # no handler: it dies of the signal, and so does the client
    client.send_signal(signal.SIGTERM)
    assert client.wait(timeout=10) == -signal.SIGTERM
    assert _gone(pid)


def test_a_command_killed_outright_is_a_client_killed_outright():
    assert subprocess.run(probe(f"die={signal.SIGKILL}")).returncode == -signal.SIGKILL


def test_torchs_threads_follow_the_commands_omp_num_threads():
    """torchrun gives each rank OMP_NUM_THREADS=1, which torch reads when it is imported."""
    for threads in ("1", "2"):
        env = os.environ | {"OMP_NUM_THREADS": threads}
        result = subprocess.run(probe("threads"), env=env, capture_output=True, text=True)
        assert result.stdout == f"{threads}\n"


def test_a_killed_client_takes_its_command_with_it():
    client, pid = _started("where", "sleep")
    client.kill()
    assert client.wait(timeout=10) == -signal.SIGKILL
    assert _gone(pid)


def test_without_pidfds_the_keeper_looks_at_its_command(tmp_path):
    """A kernel before Linux 5.3 has no pidfd_open: the keeper polls, to the same effect."""
    path = str(tmp_path / "s")
    code = "import os; del os.pidfd_open; from tests import warm; warm.serve()"
    server = subprocess.Popen(
        [sys.executable, "-c", code, path, "tests._warm_probe"],
        cwd=warm.ROOT,
        stdin=subprocess.PIPE,
    )
    try:
        while not os.path.exists(path):
            assert server.poll() is None
            time.sleep(0.01)
        command = [sys.executable, "-S", str(warm.CLIENT), path, "tests._warm_probe"]
        result = subprocess.run([*command, "shout", "exit=4"], capture_output=True, text=True)
        assert (result.returncode, result.stderr) == (4, "to stderr\n")
        client = subprocess.Popen([*command, "where", "sleep"], stdout=subprocess.PIPE, text=True)
        pid = int(client.stdout.readline().split()[2])
        client.kill()
        assert client.wait(timeout=10) == -signal.SIGKILL
        assert _gone(pid)
    finally:
        server.stdin.close()
        assert server.wait(timeout=10) == 0
