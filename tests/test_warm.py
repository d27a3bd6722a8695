"""``tests/warm.py``: a command forked from the warm server behaves as the process it stands
for, as the tests that use it assume."""

import os
import signal
import subprocess
import time

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
    client = subprocess.Popen(probe("where", *words), stdout=subprocess.PIPE, text=True)
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


def test_a_signal_to_the_client_reaches_the_command_and_is_its_status():
    client, pid = _started("sleep")
    client.send_signal(signal.SIGTERM)
    assert client.wait(timeout=10) == -signal.SIGTERM
    assert _gone(pid)


def test_a_killed_client_takes_its_command_with_it():
    client, pid = _started("sleep")
    client.kill()
    assert client.wait(timeout=10) == -signal.SIGKILL
    assert _gone(pid)
