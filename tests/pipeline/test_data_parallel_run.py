"""``torchrun --nproc_per_node 2 -m honing.cli train``: two CPU ranks (gloo) train the same
steps as one process does: same batch, same loss, the same weights within float tolerance;
with generation spread over the ranks, 2 and 3 ranks train the same steps.
And a rank leaves its process group before it exits (one that exits holding a gloo group
can abort in C++ teardown: 1 run in 20 did in the two-rank run before it left)."""

import json
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from honing.backends import torchrun
from tests import warm

from ._configs import BASE

OVERRIDES = BASE | {
    "rollout.batch_size": 4,
    "trainer.val_at_start": False,
    "trainer.threads": 1,
    "trainer.lr": 1e-2,
    "trainer.micro_batch_size": 2,
    "algorithm.kl_coef": 0.05,
}


def train(
    tmp_path, name, model_dir, reward, ranks: int, steps: int, resume="never", cold=False, **values
):
    """``honing train`` on ``ranks`` torchrun ranks (1: one plain process), started warm
    (``tests/warm.py``) unless ``cold``; the metrics of steps >= 1 and the last checkpoint's
    weights, the critic's under ``critic.``."""
    values = (
        OVERRIDES
        | values
        | {
            "model.path": model_dir,
            "reward.function": reward,
            "trainer.total_steps": steps,
        }
    )
    args = ["train", *(f"{k}={v}" for k, v in values.items())]
    args += ["--output-dir", str(tmp_path / name), "--resume", resume]
    if not cold:
        command = warm.torchrun(ranks, *args) if ranks > 1 else warm.honing(*args)
    elif ranks > 1:  # torchrun's own command line; --standalone: a rendezvous on a free port
        launcher = ["-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--standalone"]
        command = [sys.executable, *launcher, "-m", "honing.cli", *args]
    else:
        command = [sys.executable, "-m", "honing.cli", *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
    metrics = [m for m in map(json.loads, lines) if m["step"] >= 1]
    checkpoint = tmp_path / name / "checkpoints" / f"step_{steps}"
    weights = load_file(checkpoint / "model.safetensors")
    state = torch.load(checkpoint / "trainer_state.pt", weights_only=False)
    critic = state["trainers"].get("critic", {}).get("module", {})
    return metrics, weights | {f"critic.{k}": v for k, v in critic.items()}


COMPARED = ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/entropy", "critic/vf_loss")
PPO = {  # two shuffled mini-batches a step: each rank must draw the same ones
    "algorithm.advantage": "gae",
    "trainer.critic_warmup_steps": 1,
    "trainer.mini_batch_size": 2,
}


def initial_weights(model_dir) -> dict[str, torch.Tensor]:
    """What every run starts from: the model's weights, and a critic on a copy of them with
    its head at zero (the names ``train`` gives them)."""
    policy = load_file(model_dir / "model.safetensors")
    critic = {f"critic.backbone.{k}": v for k, v in policy.items()}
    critic["critic.backbone.lm_head.weight"] = policy["model.embed_tokens.weight"]  # tied
    return policy | critic


def assert_same_moves(got: dict, want: dict, before: dict, rel: float = 1e-3) -> None:
    """Each tensor moved from ``before`` to the same place, within ``rel`` of how far it
    moved. Gradients summed over other ranks (or computed in other processes, on other CPUs)
    differ in the last bits, and Adam divides each element's step by its own gradient scale,
    so an element with a near-zero gradient can end ~1e-5 apart after a few steps (seen:
    1.8e-5, on tensors that moved ~0.4 in norm); another batch, another seed or a missed
    step moves every tensor differently by the order of its whole move."""
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        start = before.get(name, torch.zeros_like(tensor))  # the critic's head starts at 0
        moved = (tensor - start).norm()
        apart = (got[name] - tensor).norm()
        assert apart <= rel * moved + 1e-6, f"{name}: {apart:.3g} apart, moved {moved:.3g}"


@pytest.mark.slow
@pytest.mark.parametrize(
    "ranks, steps, overrides",
    [
        # rank 0 samples every step's batch, as one process does. PPO: step 1 fits the
        # critic alone, step 2 both; step 2's advantages come from critics that differ by
        # float rounding.
        ((1, 2), 2, PPO | {"pipeline.spread_generation": False}),
        # every rank samples its share of tasks, seeded by position: the same samples for
        # any number of ranks, so 2 and 3 ranks train the same steps.
        ((2, 3), 2, {"pipeline.rollout_chunk": 1}),
    ],
    ids=["ppo-critic", "spread-generation"],
)
def test_ranks_train_the_steps_fewer_ranks_do(
    tmp_path, micro_model_dir, digit_reward, ranks, steps, overrides
):
    args = (micro_model_dir, digit_reward)
    fewer, more = ranks
    one, one_weights = train(tmp_path, "one", *args, ranks=fewer, steps=steps, **overrides)
    two, two_weights = train(tmp_path, "two", *args, ranks=more, steps=steps, **overrides)
    assert len(one) == len(two) == steps
    spread = overrides.get("pipeline.spread_generation", True)
    for few, many in zip(one, two, strict=True):  # how many ranks sampled
        assert few.get("rollout/generation_ranks", 1) == (fewer if spread else 1)
        assert many.get("rollout/generation_ranks", 1) == (more if spread else 1)
    # the run ends with a validation, spread too: the same figures for any number of ranks
    assert one[-1].get("val/generation_ranks", 1) == (fewer if spread else 1)
    assert two[-1].get("val/generation_ranks", 1) == (more if spread else 1)
    assert one[-1]["val/accuracy"] == two[-1]["val/accuracy"]
    for a, b in zip(one, two, strict=True):
        assert a["critic/score/mean"] == b["critic/score/mean"]  # the same batch
        assert a.keys() == b.keys()
        for key in COMPARED:
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    assert ("critic/vf_loss" in one[0]) == ("algorithm.advantage" in overrides)
    assert_same_moves(two_weights, one_weights, initial_weights(micro_model_dir))


@pytest.mark.slow
def test_two_ranks_resume_as_they_would_have_continued(tmp_path, micro_model_dir, digit_reward):
    """Stopped after step 1 and resumed, two ranks train step 2 as an uninterrupted run does:
    rank 0's resumed weights and optimizer state reach the other rank before it samples."""
    args = (micro_model_dir, digit_reward)
    extra = {"pipeline.rollout_chunk": 1, "checkpoint.every": 1}
    whole, whole_weights = train(tmp_path, "whole", *args, ranks=2, steps=2, **extra)
    train(tmp_path, "cut", *args, ranks=2, steps=1, **extra)
    resumed, weights = train(tmp_path, "cut", *args, ranks=2, steps=2, resume="auto", **extra)
    assert [m["step"] for m in resumed] == [1, 2]
    assert resumed[1]["rollout/generation_ranks"] == 2
    assert resumed[1]["critic/score/mean"] == whole[1]["critic/score/mean"]
    for key in COMPARED[:-1]:
        assert resumed[1][key] == pytest.approx(whole[1][key], rel=1e-5, abs=1e-7), key
    assert_same_moves(weights, whole_weights, initial_weights(micro_model_dir))


@pytest.mark.slow
def test_when_rank_0_fails_every_rank_exits_without_waiting(tmp_path, micro_model_dir):
    """A reward that raises stops rank 0 before any update: the other rank is told the run
    failed and leaves at once; torchrun reports rank 0's error (no hang, no C++ abort)."""
    reward = tmp_path / "boom.py"
    reward.write_text(
        "def boom(response, ground_truth, **context):\n    raise ValueError('boom')\n"
    )
    started = time.monotonic()
    with pytest.raises(AssertionError) as failed:
        train(tmp_path, "boom", micro_model_dir, f"{reward}:boom", ranks=2, steps=1, cold=True)
    assert time.monotonic() - started < 120
    assert "boom" in str(failed.value) and "terminate called" not in str(failed.value)


class Sent(Exception):
    pass


@pytest.fixture
def one_rank_group():
    """A group made by the caller (a script that set up torch.distributed itself)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def joined(monkeypatch):
    """The group ``init`` joins under torchrun; one rank here (torchrun's store would wait
    for two)."""
    make = dist.init_process_group
    monkeypatch.setattr(torchrun, "world", lambda: (0, 2))
    monkeypatch.setattr(torchrun, "_attempt_store", lambda rank, size: dist.HashStore())
    monkeypatch.setattr(
        dist,
        "init_process_group",
        lambda backend, **kwargs: make("gloo", store=dist.HashStore(), rank=0, world_size=1),
    )
    yield torchrun.init(torch.device("cpu"))
    if dist.is_initialized():
        dist.destroy_process_group()


def test_a_rank_leaves_the_group_it_joined_once(joined):
    torchrun.leave(joined, wait=True)
    assert not dist.is_initialized()
    torchrun.leave(joined, wait=False)  # the finally after a clean leave
    torchrun.leave(None, wait=True)  # one process: nothing to leave


def test_a_group_the_caller_made_is_left_to_it(one_rank_group):
    torchrun.leave(one_rank_group, wait=True)
    assert dist.is_initialized()


def test_the_others_are_told_how_the_run_ended(joined, monkeypatch):
    stops = []
    monkeypatch.setattr(torchrun.Leader, "stop", lambda self, failed: stops.append(failed))
    replicated = SimpleNamespace(is_sharded=False, passes_together=False)  # replicated ops
    parts = SimpleNamespace(trainers=SimpleNamespace(policy=replicated))
    with torchrun.lead(joined, parts, None) as leader:
        assert leader.parts is parts
    with pytest.raises(Sent), torchrun.lead(joined, parts, None):
        raise Sent
    with pytest.raises(Sent), torchrun.lead(joined, parts, None) as leader:
        leader.busy = True  # failed inside shared work: the others wait in its collectives
        raise Sent
    assert stops == [False, True]
    with torchrun.lead(None, parts, None) as leader:  # one process: no leader
        assert leader is None
