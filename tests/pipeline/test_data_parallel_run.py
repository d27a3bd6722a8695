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


def train(tmp_path, name, model_dir, reward, ranks: int, steps: int, **overrides):
    values = (
        OVERRIDES
        | overrides
        | {
            "model.path": model_dir,
            "reward.function": reward,
            "trainer.total_steps": steps,
        }
    )
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
    checkpoint = tmp_path / name / "checkpoints" / f"step_{steps}"
    weights = load_file(checkpoint / "model.safetensors")
    state = torch.load(checkpoint / "trainer_state.pt", weights_only=False)
    return metrics, weights | {f"critic.{k}": v for k, v in state.get("critic", {}).items()}


COMPARED = ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/entropy", "critic/vf_loss")
PPO = {  # two shuffled mini-batches a step: each rank must draw the same ones
    "algorithm.advantage": "gae",
    "trainer.critic_warmup_steps": 1,
    "trainer.mini_batch_size": 2,
}


@pytest.mark.slow
@pytest.mark.parametrize(
    "steps, overrides",
    [(1, {}), (2, PPO)],  # PPO: step 1 fits the critic alone, step 2 both
    ids=["grpo", "ppo-critic"],
)
def test_two_ranks_train_the_steps_one_process_does(
    tmp_path, micro_model_dir, digit_reward, steps, overrides
):
    args = (micro_model_dir, digit_reward)
    one, one_weights = train(tmp_path, "one", *args, ranks=1, steps=steps, **overrides)
    two, two_weights = train(tmp_path, "two", *args, ranks=2, steps=steps, **overrides)
    assert len(one) == len(two) == steps
    for a, b in zip(one, two, strict=True):
        assert a["critic/score/mean"] == b["critic/score/mean"]  # the same batch
        assert a.keys() == b.keys()
        for key in COMPARED:
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    assert ("critic/vf_loss" in one[0]) == bool(overrides)
    assert one_weights.keys() == two_weights.keys()
    for name, want in one_weights.items():
        torch.testing.assert_close(two_weights[name], want, atol=1e-4, rtol=1e-3)


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
