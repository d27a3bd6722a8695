"""``torchrun --nproc_per_node 2 -m honing.cli train``: two CPU ranks (gloo) train the same
step as one process does: same batch, same loss, the same weights within float tolerance.
And a rank leaves its process group before it exits (one that exits holding a gloo group
can abort in C++ teardown: 1 run in 20 did in the two-rank run before it left)."""

import json
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from honing.pipeline import data_parallel

from ._configs import BASE

OVERRIDES = BASE | {
    "rollout.batch_size": 4,
    "trainer.val_at_start": False,
    "trainer.threads": 1,
    "trainer.lr": 1e-2,
    "trainer.micro_batch_size": 2,
    "algorithm.kl_coef": 0.05,
}


def train(tmp_path, name, model_dir, reward, ranks: int, steps: int):
    values = OVERRIDES | {
        "model.path": model_dir,
        "reward.function": reward,
        "trainer.total_steps": steps,
    }
    command = ["-m", "honing.cli", "train", *(f"{k}={v}" for k, v in values.items())]
    command += ["--output-dir", str(tmp_path / name), "--resume", "never"]
    if ranks > 1:
        launcher = ["-m", "torch.distributed.run", "--nproc_per_node", str(ranks)]
        launcher += ["--standalone"]  # a local rendezvous on a free port
        command = launcher + command
    result = subprocess.run([sys.executable, *command], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
    metrics = [m for m in map(json.loads, lines) if m["step"] >= 1]
    weights = load_file(tmp_path / name / "checkpoints" / f"step_{steps}" / "model.safetensors")
    return metrics, weights


@pytest.mark.slow
def test_two_ranks_train_the_step_one_process_does(tmp_path, micro_model_dir, digit_reward):
    one, one_weights = train(tmp_path, "one", micro_model_dir, digit_reward, ranks=1, steps=1)
    two, two_weights = train(tmp_path, "two", micro_model_dir, digit_reward, ranks=2, steps=1)
    assert one[0]["critic/score/mean"] == two[0]["critic/score/mean"]  # the same batch
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/entropy"):
        assert two[0][key] == pytest.approx(one[0][key], rel=1e-4, abs=1e-6), key
    assert one_weights.keys() == two_weights.keys()
    for name, want in one_weights.items():
        torch.testing.assert_close(two_weights[name], want, atol=1e-5, rtol=1e-4)


class Sent(Exception):
    pass


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    if dist.is_initialized():
        dist.destroy_process_group()


def test_a_rank_leaves_its_group_once(one_rank_group):
    data_parallel.leave(one_rank_group, wait=True)
    assert not dist.is_initialized()
    data_parallel.leave(one_rank_group, wait=False)  # the finally after a clean leave
    data_parallel.leave(None, wait=True)  # one process: nothing to leave


def test_the_others_are_told_the_run_ended_however_it_ends(one_rank_group, monkeypatch):
    stops = []
    monkeypatch.setattr(data_parallel.Leader, "stop", lambda self: stops.append(self))
    parts = type("Parts", (), {"critic": None})()
    with data_parallel.lead(one_rank_group, parts) as leader:
        assert leader.parts is parts
    with pytest.raises(Sent), data_parallel.lead(one_rank_group, parts):
        raise Sent
    assert len(stops) == 2
    with data_parallel.lead(None, parts) as leader:  # one process: no leader
        assert leader is None
