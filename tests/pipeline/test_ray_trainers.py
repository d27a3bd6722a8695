"""A trainer group under Ray (``pipeline.trainer_workers``): trainer actors that are
torchrun's ranks (gloo here), one placement group, rank 0 sampling through the rollout
workers. The group trains what one trainer actor does, sharded or sequence-parallel."""

import json
import subprocess
import time

import pytest
import torch
from safetensors.torch import load_file

ray = pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")  # a dependency of ray

from honing.backends.launch import train  # noqa: E402
from tests import warm  # noqa: E402

from ._configs import cli_args, small_run_config  # noqa: E402
from .test_ray_backend import cluster  # noqa: E402, F401  (a local instance for this module)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("cluster")]


def _run(tmp_path, model_dir, reward, name, **overrides):
    values = {"pipeline.backend": "ray", "pipeline.rollout_workers": 1}
    values |= {"pipeline.reward_workers": 0, "trainer.total_steps": 2}
    values |= {"trainer.val_at_start": False, "checkpoint.every": 2, "algorithm.kl_coef": 0.05}
    values |= {"trainer.lr": 3e-3}  # updates that move the weights far past the tolerance
    config = small_run_config(model_dir, reward, **values | overrides)
    train(config, tmp_path / name, log=lambda message: None)
    lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
    steps = [m for m in map(json.loads, lines) if "samples/generated" in m]
    weights = {}
    for shard in (tmp_path / name / "checkpoints" / "step_2").glob("*.safetensors"):
        weights |= load_file(shard)
    return steps, {k: v for k, v in weights.items() if not k.endswith("lm_head.weight")}


def test_two_trainer_actors_train_what_one_does(tmp_path, micro_model_dir, digit_reward):
    """Two trainer actors, FSDP over gloo, reach the weights one trainer actor reaches from
    the same samples (the rollout workers draw each task by its place in the batch); float
    sums in another order differ by ~1e-7. (Sequence-parallel actors: the restart test.)"""
    args = (tmp_path, micro_model_dir, digit_reward)
    one, one_weights = _run(*args, "one")
    start = load_file(micro_model_dir / "model.safetensors")
    assert max((one_weights[k] - start[k]).abs().max().item() for k in one_weights) > 1e-3
    group = {"pipeline.trainer_workers": 2, "trainer.strategy": "fsdp"}
    two, weights = _run(*args, "fsdp", **group)
    assert [m["critic/score/mean"] for m in two] == [m["critic/score/mean"] for m in one]
    assert [m["dist/world_size"] for m in two] == [2.0, 2.0]
    assert one_weights.keys() == weights.keys()
    for key, want in one_weights.items():
        torch.testing.assert_close(weights[key], want, atol=1e-4, rtol=0, msg=key)
    # each sharded rank holds half the parameters, gradients and optimizer state
    assert two[-1]["memory/model_state_mb"] <= 0.55 * one[-1]["memory/model_state_mb"]


def _trainer_actors() -> list:
    """The trainer actors' processes of this module's cluster (its raylet is this process's
    child; another module's cluster may run beside it)."""
    found = []
    for process in psutil.Process().children(recursive=True):
        try:
            if (process.cmdline() or [""])[0].startswith("ray::TrainerActor"):
                found.append(process)
        except psutil.Error:  # gone meanwhile
            pass
    return found


def test_a_lost_trainer_actor_restarts_the_run_from_its_checkpoint(
    tmp_path, micro_model_dir, digit_reward
):
    """A trainer actor killed mid-run (its node lost) ends the run as a crash in one line;
    under --max-restarts the group (two actors sharing each sequence) starts again from the
    newest checkpoint and finishes."""
    run_dir = tmp_path / "run"
    values = {"pipeline.backend": "ray", "pipeline.trainer_workers": 2}
    values |= {"pipeline.rollout_workers": 1, "pipeline.reward_workers": 0}
    values |= {"trainer.sequence_parallel": 2, "trainer.total_steps": 2, "checkpoint.every": 1}
    values["pipeline.ray_address"] = ray.get_runtime_context().gcs_address  # this module's
    values |= {"trainer.val_at_start": False}
    args = cli_args(micro_model_dir, digit_reward, run_dir, **values)
    process = subprocess.Popen(
        warm.honing("train", *args, "--max-restarts", "1"),
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while not (run_dir / "checkpoints" / "step_1").is_dir():
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        actors = _trainer_actors()
        assert len(actors) == 2
        max(actors, key=lambda p: p.pid).kill()  # rank 1, started second
        _, stderr = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, stderr[-3000:]
    assert "the trainer actor of rank 1 died" in stderr
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert [e["exit_status"] for e in events if e["kind"] == "restart"] == [1]
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    steps = [r for r in map(json.loads, lines) if "samples/generated" in r]
    assert max(r["step"] for r in steps) == 2
    assert {r["dist/world_size"] for r in steps} == {2.0}
