"""The policy update under ``trainer.sequence_parallel=2``: two gloo ranks, one data-parallel
slot, share every sequence of every micro-batch (packed forward, the model's own forward, and
FSDP over both ranks), and end one GRPO optimizer step where one process does.

Tolerance: float32 throughout. Each rank runs half of every sequence (other matmul shapes),
attention sums in another order, and the gradient is the sum of two ranks' parts: agreement
to float32 reassociation, ~1e-6 relative, as ``test_sequence_parallel.py``'s logprobs; the
weights after one SGD(lr=0.1) step then differ by ~1e-7."""

import dataclasses

import pytest
import torch
import torch.distributed as dist

from honing.config import build_config
from honing.errors import ConfigError
from honing.models.loading import load_causal_lm, load_tokenizer
from honing.pipeline.rules import check_config
from honing.trainer.engine import TrainedModule, make_layout
from honing.trainer.policy_update import update_policy

from .ranks import on_ranks
from .test_policy_update import make_experience, settings_for

CPU = torch.device("cpu")
WORLD = 2
LENGTHS = [40, 2, 3, 1, 20, 4, 2, 5, 1, 3, 2, 6]  # the micro model takes 64 positions
# (strategy, packed forward, trainer.max_tokens_per_micro): the budget counts a micro-batch's
# whole rows, which the slot's ranks share
CASES = (
    ("replicate", True, 0),
    ("replicate", False, 0),
    ("fsdp", False, 0),
    ("replicate", True, 64),
)


def _policy(model_dir: str, strategy: str, group, sequence: int = 1) -> TrainedModule:
    torch.manual_seed(0)
    tokenizer = load_tokenizer(model_dir)
    model = load_causal_lm(model_dir, tokenizer, dtype="float32", device=CPU)

    def optimizer(module):
        return torch.optim.SGD(module.parameters(), lr=0.1), None

    layout = make_layout(strategy, group, sequence=sequence)
    return TrainedModule.laid_out("policy", model, layout, optimizer, serves_generation=True)


def _update(
    model_dir: str, strategy: str, packed: bool, budget: int, group, sequence: int = 1
) -> dict:
    """One update of a fresh policy (micro-batches of 4 rows: 3 per step, or by a token
    ``budget``) and a pass without gradient before it; the whole weights, metrics and old
    logprobs."""
    policy = _policy(model_dir, strategy, group, sequence)
    plain = _policy(model_dir, strategy, None).module  # the experience, alike everywhere
    batch, advantages, old, ref = make_experience(plain, LENGTHS)
    settings = dataclasses.replace(
        settings_for("token_mean", 4), packed=packed, max_tokens_per_micro=budget
    )
    with torch.no_grad():
        passed = policy.forward_rows(
            lambda rows: policy.response_logprobs(policy.module, rows, packed=packed)[0],
            batch,
            batch.responses.shape[1],
        )
    metrics = update_policy(policy, batch, advantages, settings, old_logprobs=old, ref_logprobs=ref)
    weights = {name: t.clone() for name, t in policy.whole_tensors()}
    return {"weights": weights, "metrics": metrics, "old": passed, "mask": batch.response_mask}


def _on_rank(model_dir: str) -> dict:
    """Every case's update on this rank, with both ranks in one slot."""
    return {case: _update(model_dir, *case, dist.group.WORLD, WORLD) for case in CASES}


@pytest.mark.slow  # gloo ranks spawned, each importing torch
def test_two_ranks_sharing_each_sequence_end_where_one_process_does(micro_model_dir, tmp_path):
    model_dir = str(micro_model_dir)
    alone = {
        (packed, budget): _update(model_dir, "replicate", packed, budget, None)
        for _, packed, budget in CASES
    }
    ranks = on_ranks(_on_rank, str(tmp_path / "rank"), WORLD, model_dir)
    whole = _policy(model_dir, "replicate", None).module.parameters()
    weights_mb = {"replicate": 0.0, "fsdp": sum(p.numel() * 4 for p in whole) / 2**20}
    for strategy, packed, budget in CASES:
        want = alone[packed, budget]
        moved = max(
            float((want["weights"][n] - t).abs().max())
            for n, t in _policy(model_dir, "replicate", None).module.state_dict().items()
        )
        assert moved > 1e-4  # the step moved the weights: their equality says something
        for found in ranks:
            got = found[strategy, packed, budget]
            real = want["mask"]  # the model's own forward leaves padding's logprobs in
            torch.testing.assert_close(got["old"] * real, want["old"] * real, atol=1e-5, rtol=0)
            for name, tensor in got["weights"].items():  # FSDP gives a tied head once
                torch.testing.assert_close(tensor, want["weights"][name], atol=1e-6, rtol=1e-5)
            for name, value in want["metrics"].items():
                if name.startswith("memory/"):  # per rank: below
                    continue
                assert got["metrics"][name] == pytest.approx(value, rel=1e-4, abs=1e-6), name
            # one slot: every rank ran all the micro-batches (3 of 4 rows; 4 under the
            # budget), the slot's mean is all tokens
            assert got["metrics"]["perf/micro_batches"] == (4 if budget else 3)
            assert got["metrics"]["perf/token_imbalance"] == 1.0
            # What a rank's forward keeps for backward is about half one process's: every
            # per-token activation is split, attention's exchanged q/k/v are the whole
            # sequence's for half the heads; the [B, 1, T, T] mask and the gathered [B, R]
            # logprobs are whole on each rank (here ~3%), and FSDP's gathered weights count
            # too (taken out: the whole parameters, once).
            mine = got["metrics"]["memory/activation_peak_mb"] - weights_mb[strategy]
            assert 0.45 < mine / want["metrics"]["memory/activation_peak_mb"] < 0.6


def test_activation_peak_grows_with_the_response_length(micro_model_dir):
    """One process, the model's own forward: 4 responses of 40 tokens keep ~4x what 4 of 10
    do (prompt width 7: 47 vs 17 positions; per-token activations linear in them, the
    attention mask quadratic), in one micro-batch each."""
    model = _policy(str(micro_model_dir), "replicate", None).module
    peaks = []
    for length in (10, 40):
        batch, advantages, old, ref = make_experience(model, [length] * 4)
        settings = dataclasses.replace(settings_for("token_mean", 4), packed=False)
        policy = _policy(str(micro_model_dir), "replicate", None)
        metrics = update_policy(
            policy, batch, advantages, settings, old_logprobs=old, ref_logprobs=ref
        )
        peaks.append(metrics["memory/activation_peak_mb"])
    assert peaks[0] > 0 and 2.5 < peaks[1] / peaks[0] < 5


def test_sequence_parallel_is_refused_where_it_cannot_run():
    def refused(overrides: dict, world_size: int) -> str:
        with pytest.raises(ConfigError) as caught:
            check_config(build_config({"trainer.sequence_parallel": 2} | overrides), world_size)
        return str(caught.value)

    assert "needs torchrun ranks" in refused({}, 1)
    assert "3 torchrun ranks do not split into groups of 2" in refused({}, 3)
    check_config(build_config({"trainer.sequence_parallel": 2}), 4)  # 2 slots of 2 ranks
    with pytest.raises(ConfigError, match="sequence_parallel: 0 is out of range"):
        build_config({"trainer.sequence_parallel": 0})
