"""A cluster of two Ray nodes on loopback, started as a cluster's nodes are (``ray start``): the
head and a spot node (custom resource ``spot``), in a network namespace that holds loopback
alone (``unshare -rn``), where Ray keeps a second node of one machine on 127.0.0.1 (elsewhere
``ray start`` moves it to the machine's network address, or refuses it in Ray's one-machine
mode). A ``honing train`` run joins the head at 127.0.0.1:P; its rollout workers ask for
``spot`` and run on the spot node. The spot node is killed mid-run (its raylet, agents and
workers at once: a preemption) and a new one joins, as a preempted spot group gets a new node.
The run finishes, every sample accounted for, with one event naming the node and the workers
lost with it.

This is a pytest module run as a benchmark (a minute of ``ray start`` nodes, namespaces and
health checks is past the suite's time budget; ``tests/pipeline/test_ray_placement.py`` does
the same loss on Ray's in-process test cluster in the suite), with the suite's fixtures:

    .venv/bin/python -m benchmarks.ray_nodes      # pytest -p tests.conftest on this file
"""

import contextlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

psutil = pytest.importorskip("psutil")
pytest.importorskip("ray")

from tests.pipeline._configs import cli_args  # noqa: E402

pytestmark = pytest.mark.slow

RAY = str(Path(sys.executable).with_name("ray"))
PORT = 6379  # the namespace's own loopback: no other cluster is there
LOOPBACK = {"127.0.0.1", "::ffff:127.0.0.1"}
SPOT = ("--num-cpus", 2, "--resources", '{"spot": 2}')  # room for the two rollout workers
STEPS = 4
GROUP = 3  # rollout.group_size: samples a prompt
BATCH = 2 * GROUP  # rollout.batch_size prompts
PARTS = ("trained", "filtered", "failed", "stale", "discarded")
# The GCS marks a node dead after 3 missed health checks of a second (Ray's default: 5 of
# 3 s); the run starts the lost workers' replacements once it has.
HEALTH_CHECKS = {"RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3"}


# digit_reward's function, held while the gate file exists (a second file says it is held): the
# run stays in step 1, its samples made on the spot node, while the test kills the node.
GATED_REWARD = """
import os, time


def digit_fraction(response, ground_truth, **context):
    while os.path.exists({gate!r}):
        open({held!r}, "a").close()
        time.sleep(0.05)
    return sum(c.isdigit() for c in response) / max(len(response), 1)
"""


def _namespaces_work() -> bool:
    if not (shutil.which("nsenter") and os.path.exists(RAY)):
        return False
    try:
        probe = ["unshare", "-rn", "sh", "-c", "ip link set lo up"]
        return subprocess.run(probe, capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


class Loopback:
    """A network namespace holding loopback alone (kept by a ``sleep``), commands run in it,
    and the Ray nodes started there, each with a temporary directory of its own (short: Ray's
    socket paths must stay under 108 bytes)."""

    def __init__(self):
        self.keeper = subprocess.Popen(
            ["unshare", "-rn", "sh", "-c", "ip link set lo up && echo up && exec sleep 3600"],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.keeper.stdout.readline().strip() == "up"
        # The cluster's token, as a cluster of several machines shares one: the head asks for
        # it because there is one; a node joining at an explicit address sends it only with
        # RAY_AUTH_MODE=token (Ray's rule); a run joining a loopback address sends it as is.
        self.env = dict(os.environ, RAY_AUTH_TOKEN=secrets.token_hex(32))
        for name in ("RAY_AUTH_MODE", "RAY_ADDRESS"):
            self.env.pop(name, None)
        self.dirs: list[str] = []

    def command(self, *argv) -> list[str]:
        enter = ["nsenter", "-t", str(self.keeper.pid), "-U", "-n", "--preserve-credentials"]
        return [*enter, *map(str, argv)]

    def start_node(self, *args, head: bool = False) -> tuple[str, subprocess.Popen]:
        """``ray start`` of a node at 127.0.0.1 (the head, or one joining it); returns its
        temporary directory and the ``ray start`` process (done once the node is up)."""
        temp = tempfile.mkdtemp(prefix="hn", dir="/tmp")
        self.dirs.append(temp)
        where = ["--head", "--port", PORT, "--include-dashboard=false"] if head else []
        where = where or ["--address", f"127.0.0.1:{PORT}"]
        env = self.env | (HEALTH_CHECKS if head else {"RAY_AUTH_MODE": "token"})
        command = [RAY, "start", *where, "--node-ip-address", "127.0.0.1", "--temp-dir", temp]
        command += ["--disable-usage-stats", *args]
        process = subprocess.Popen(
            self.command(*command), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        return temp, process

    def processes(self, temp: str) -> list:
        """A node's processes: those naming its directory, and their descendants."""
        found = {}
        for process in psutil.process_iter(["cmdline"]):
            try:
                if temp in " ".join(process.info["cmdline"] or []):
                    for each in [process, *process.children(recursive=True)]:
                        found[each.pid] = each
            except psutil.Error:
                continue
        return list(found.values())

    def kill_node(self, temp: str) -> None:
        for process in self.processes(temp):
            with contextlib.suppress(psutil.Error):
                process.kill()

    def close(self) -> None:
        for temp in self.dirs:
            self.kill_node(temp)
        self.keeper.kill()
        self.keeper.wait()
        for temp in self.dirs:
            shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture
def loopback():
    if not _namespaces_work():
        pytest.skip("needs unshare -rn (user and network namespaces), nsenter and ip")
    namespace = Loopback()
    try:
        yield namespace
    finally:
        namespace.close()


def _started(node: tuple[str, subprocess.Popen]) -> str:
    temp, process = node
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 0, stderr.decode()[-3000:]
    return temp


def _raylet(namespace: Loopback, temp: str):
    return next(p for p in namespace.processes(temp) if p.name() == "raylet")


def _node_id(raylet) -> str:
    flag = next(arg for arg in raylet.cmdline() if arg.startswith("--node_id="))
    return flag.split("=", 1)[1]


def _rollout_workers(raylet) -> list:
    """The rollout workers' processes under a raylet (titled ``ray::RolloutWorker...``)."""
    found = []
    for process in raylet.children(recursive=True):
        try:
            if " ".join(process.cmdline()).startswith("ray::RolloutWorker"):
                found.append(process)
        except psutil.Error:
            continue
    return found


# psutil reads a process's sockets from the tables of its caller's network namespace: it
# runs in the cluster's.
LISTENING = """
import json, sys, psutil
out = []
for pid in map(int, sys.argv[1:]):
    try:
        process = psutil.Process(pid)
        for c in process.net_connections(kind="inet"):
            if c.status == psutil.CONN_LISTEN:
                out.append((c.laddr.ip, c.laddr.port, process.name()))
    except psutil.Error:
        continue
print(json.dumps(out))
"""


def _listening(namespace: Loopback, processes) -> set[tuple[str, int, str]]:
    """The addresses ``processes`` listen on: (ip, port, process name)."""
    pids = [str(p.pid) for p in processes]
    command = namespace.command(sys.executable, "-c", LISTENING, *pids)
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, check=True)
    return {tuple(each) for each in json.loads(result.stdout)}


def _lines(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _steps(run_dir: Path) -> list[dict]:
    return [m for m in _lines(run_dir / "metrics.jsonl") if "samples/generated" in m]


def _wait(what: str, check, run: subprocess.Popen, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if found := check():
            return found
        assert run.poll() is None, f"the run ended before {what}: {run.stderr.read()[-3000:]}"
        time.sleep(0.1)
    raise AssertionError(f"no {what} within {timeout_s:g} s")


@pytest.fixture
def gated_reward(tmp_path) -> tuple[str, Path, Path]:
    """``GATED_REWARD``'s spec, its gate (closed) and the file that says it is held."""
    gate, held = tmp_path / "gate", tmp_path / "held"
    gate.touch()
    path = tmp_path / "gated_reward.py"
    path.write_text(GATED_REWARD.format(gate=str(gate), held=str(held)))
    return f"{path}:digit_fraction", gate, held


def test_a_spot_node_lost_mid_run_on_loopback(loopback, tmp_path, micro_model_dir, gated_reward):
    """The run starts while the spot node joins (its rollout workers wait for it); the
    servers of both nodes, their workers and the run's process listen on loopback alone. The
    spot node is lost while step 1 is scored: step 2's tasks fail there and run again on the
    new node."""
    reward, gate, held = gated_reward
    head = _started(loopback.start_node("--num-cpus", 1, head=True))  # the trainer's CPU
    spot = loopback.start_node(*SPOT)
    run_dir = tmp_path / "run"
    overrides = {
        "pipeline.backend": "ray",
        "pipeline.ray_address": f"127.0.0.1:{PORT}",
        "pipeline.rollout_resources": "spot=1",
        "pipeline.rollout_workers": 2,
        "pipeline.reward_workers": 0,
        "pipeline.rollout_chunk": 1,  # a task per prompt: both workers busy in a step
        "schedule.mode": "sync",
        "trainer.total_steps": STEPS,
        "trainer.val_at_start": False,
        "rollout.max_new_tokens": 8,
    }
    argv = [sys.executable, "-m", "honing.cli", "train"]
    argv += cli_args(micro_model_dir, reward, run_dir, **overrides)
    run = subprocess.Popen(
        loopback.command(*argv), env=loopback.env, stderr=subprocess.PIPE, text=True
    )
    try:
        spot_raylet = _raylet(loopback, _started(spot))
        workers = _wait(
            "two rollout workers on the spot node",
            lambda: len(found := _rollout_workers(spot_raylet)) == 2 and found,
            run,
        )
        assert _rollout_workers(_raylet(loopback, head)) == []
        processes = loopback.processes(head) + loopback.processes(spot[0]) + workers
        listening = _listening(loopback, [*processes, psutil.Process(run.pid)])
        assert {ip for ip, _, _ in listening} <= LOOPBACK, listening
        assert (PORT, "gcs_server") in {(port, name) for _, port, name in listening}
        _wait("step 1's samples, scored", held.exists, run)
        lost_node = _node_id(spot_raylet)
        loopback.kill_node(spot[0])  # a preemption: the raylet, its agents and workers at once
        _started(loopback.start_node(*SPOT))  # the spot group's new node
        gate.unlink()
        _, stderr = run.communicate(timeout=240)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, stderr[-3000:]
    metrics = _steps(run_dir)
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    for m in metrics:  # each step's batch once: what is sampled again is not trained twice
        assert m["samples/generated"] == BATCH, m
        assert m["samples/generated"] == sum(m.get(f"samples/{part}", 0) for part in PARTS), m
    regenerated = sum(m["samples/regenerated"] for m in metrics)
    events = _lines(run_dir / "events.jsonl")
    assert [e["kind"] for e in events if "worker" in e["kind"] or "node" in e["kind"]] == [
        "rollout_node_lost"
    ], events
    lost = next(e for e in events if e["kind"] == "rollout_node_lost")
    assert lost["node"] == lost_node
    assert sorted(name.rsplit("/", 1)[1] for name in lost["workers"]) == [
        "rollout-1",
        "rollout-2",
    ]
    assert len(lost["new"]) == 2
    assert 0 < regenerated == lost["tasks"] * GROUP  # its tasks (a prompt each), sampled again


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-p", "tests.conftest", "-q", "-s", "--durations=1"]))
