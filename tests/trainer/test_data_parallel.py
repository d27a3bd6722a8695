"""Data-parallel update: two gloo processes on the same batch end with the parameters and
metrics of one process (within float tolerance), for several mini-batch / micro-batch splits."""

import dataclasses
import json

import pytest
import torch
import torch.distributed as dist

from honing.algorithms.rollout_correction import CorrectionSettings
from honing.models.loading import load_causal_lm, load_tokenizer
from honing.trainer.batch import collate
from honing.trainer.engine import TrainedModule
from honing.trainer.layouts import OneProcess, Replicated
from honing.trainer.policy_update import UpdateSettings, update_policy

from .ranks import on_ranks
from .test_policy_update import PAD, make_rollouts

CPU = torch.device("cpu")
WORLD = 2


def _setup(model_dir: str):
    torch.manual_seed(0)
    tokenizer = load_tokenizer(model_dir)
    model = load_causal_lm(model_dir, tokenizer, dtype="float32", device=CPU)
    batch = collate(make_rollouts(), pad_id=PAD, device=CPU)
    gen = torch.Generator().manual_seed(1)
    advantages = torch.randn(batch.responses.shape, generator=gen) * batch.response_mask
    old = torch.randn(batch.responses.shape, generator=gen) * 0.1 - 2.0
    ref = torch.randn(batch.responses.shape, generator=gen) * 0.1 - 2.0
    return model, batch, advantages, old, ref


def _run(model_dir: str, settings: UpdateSettings, group=None):
    model, batch, advantages, old, ref = _setup(model_dir)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)  # the change is the gradient
    layout = Replicated(group) if group is not None else OneProcess()
    metrics = update_policy(
        TrainedModule("policy", model, optimizer, layout=layout),
        batch,
        advantages,
        settings,
        old_logprobs=None if settings.gap else old,
        ref_logprobs=ref,
        generator=torch.Generator().manual_seed(5),
    )
    return model, metrics


def _on_rank(model_dir: str, settings: UpdateSettings) -> dict:
    model, metrics = _run(model_dir, settings, group=dist.group.WORLD)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"state": state, "metrics": metrics}


@pytest.mark.slow  # gloo ranks spawned, each importing torch
@pytest.mark.parametrize(
    "split",
    [
        {"mini_batch_sequences": 0, "micro_batch_size": 64},  # one step, one micro-batch a rank
        {"mini_batch_sequences": 6, "micro_batch_size": 2, "ppo_epochs": 2},  # 4 steps
        # one step whose forward gives the old logprobs: the rollout correction's metrics are
        # the sums and counts of both ranks' tokens
        {"micro_batch_size": 2, "gap": True, "correction": CorrectionSettings("sequence", 1.5)},
    ],
)
def test_two_ranks_end_where_one_process_does(micro_model_dir, tmp_path, split):
    settings = dataclasses.replace(
        UpdateSettings(kl_coef=0.05, entropy_coef=0.01, grad_clip=1.0), **split
    )
    single, single_metrics = _run(str(micro_model_dir), settings)
    ranks = on_ranks(_on_rank, str(tmp_path / "rank"), WORLD, str(micro_model_dir), settings)
    before = _setup(str(micro_model_dir))[0].state_dict()
    moved = 0
    for name, want in single.state_dict().items():
        moved += bool((want - before[name]).abs().max() > 0)
        for rank in ranks:
            torch.testing.assert_close(rank["state"][name], want, atol=1e-6, rtol=1e-5)
    assert moved >= len(before) // 2  # the update did change the weights
    assert torch.equal(ranks[0]["state"]["lm_head.weight"], ranks[1]["state"]["lm_head.weight"])
    for key, want in single_metrics.items():
        if key.startswith(("perf/", "memory/")):  # how the rows were split, which ranks change
            continue
        for rank in ranks:
            assert rank["metrics"][key] == pytest.approx(want, rel=1e-4, abs=1e-6), key
    json.dumps(single_metrics)  # plain floats
    assert ("rollout_corr/chi2_seq" in single_metrics) == bool(settings.correction)


def test_a_mini_batch_smaller_than_the_ranks_is_refused(micro_model_dir, monkeypatch):
    monkeypatch.setattr(dist, "get_rank", lambda group: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda group: 2)  # before any collective
    settings = UpdateSettings(mini_batch_sequences=1)
    model, batch, advantages, old, _ = _setup(str(micro_model_dir))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = TrainedModule("policy", model, optimizer, layout=Replicated(object()))
    with pytest.raises(ValueError, match="cannot be shared by 2 data-parallel ranks"):
        update_policy(engine, batch, advantages, settings, old_logprobs=old)
