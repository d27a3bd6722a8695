"""Token-budget micro-batches (``trainer.max_tokens_per_micro``): the rows dealt to the ranks by
their tokens, each rank's packed under the budget, and the update's gradient unchanged by it.

A budget split is one more way to cut a mini-batch into micro-batches, and every micro-batch
loss is normalised by the whole mini-batch's counts, so the accumulated gradient is the
mini-batch's in every ``algorithm.loss_agg`` mode, in one process and on gloo ranks.
"""

import dataclasses

import pytest
import torch
import torch.distributed as dist

from honing.algorithms.losses import LOSS_AGGREGATIONS
from honing.config import build_config
from honing.errors import ConfigError
from honing.pipeline.components import update_settings
from honing.trainer.layouts import OneProcess, Replicated, deal_rows, pack_rows
from honing.trainer.policy_update import row_tokens, update_policy
from honing.trainer.sharded import Sharded

from .ranks import on_ranks
from .test_layouts import _policy
from .test_policy_update import make_experience, settings_for, sgd_step

CPU = torch.device("cpu")
# A few long responses among many short ones (the micro model takes 64 positions).
MIXED_LENGTHS = [40, 2, 3, 1, 20, 4, 2, 5, 1, 3, 2, 6]
BUDGET = 32  # under the longest row's 47 tokens (prompt width 7), which goes alone
TOKENS = [47, 9, 10, 8, 27, 11, 9, 12, 8, 10, 9, 13]  # MIXED_LENGTHS' rows' tokens
MODES = sorted(LOSS_AGGREGATIONS)
WORLD = 2


@pytest.fixture(scope="module")
def mixed(micro_model_dir):
    """The model directory, the model, and an experience batch of MIXED_LENGTHS."""
    model = _policy(str(micro_model_dir), "fsdp", None).module  # no group: one process
    return str(micro_model_dir), model, make_experience(model, MIXED_LENGTHS)


# --- packing and dealing ---------------------------------------------------------------------


def test_packing_keeps_every_micro_batch_under_the_budget():
    tokens = torch.tensor(TOKENS)
    index = torch.arange(100, 112)  # row ids, not positions: packing hands back the ids
    micro_batches = pack_rows(index, tokens, BUDGET)
    assert sorted(torch.cat(micro_batches).tolist()) == index.tolist()  # every row once
    by_id = dict(zip(index.tolist(), tokens.tolist(), strict=True))
    costs = [len(m) * max(by_id[i] for i in m.tolist()) for m in micro_batches]
    assert [len(m) for m in micro_batches] == [1, 1, 2, 2, 3, 3]  # 27 x 1, 13 x 2, 10 x 3...
    assert micro_batches[0].tolist() == [100] and costs[0] == 47  # over the budget, alone
    assert all(cost <= BUDGET for cost in costs[1:])


def test_dealing_balances_the_ranks_tokens_within_the_longest_row():
    generator = torch.Generator().manual_seed(3)
    for world in (2, 3, 4):
        for _ in range(20):
            count = int(torch.randint(world, 40, (1,), generator=generator))
            tokens = torch.randint(10, 60, (count,), generator=generator)
            long = torch.randperm(count, generator=generator)[:2]  # a few long, anywhere
            tokens[long] = torch.randint(500, 2000, (2,), generator=generator)
            shares = deal_rows(tokens, world)
            assert sorted(sum(shares, [])) == list(range(count))  # every row exactly once
            loads = [int(tokens[share].sum()) for share in shares]
            assert max(loads) - min(loads) <= int(tokens.max())
            assert all(shares)  # no rank left without a row


def test_ranks_split_a_mixed_batch_by_tokens(monkeypatch):
    tokens = torch.tensor(TOKENS)
    index = torch.arange(12)
    monkeypatch.setattr(dist, "get_world_size", lambda group: WORLD)  # no process group
    found = {}
    for rank in range(WORLD):
        monkeypatch.setattr(dist, "get_rank", lambda group, rank=rank: rank)
        found[rank] = {
            layout.__name__: layout(object()).rows(index, 4, tokens, BUDGET)
            for layout in (Replicated, Sharded)
        }
    loads = []
    for layouts in found.values():
        real = [chunk[:count] for chunk, count in layouts["Replicated"]]
        assert [(c.tolist(), n) for c, n in layouts["Sharded"][: len(real)]] == [
            (c.tolist(), len(c)) for c in real
        ]
        loads.append(int(tokens[torch.cat(real)].sum()))
    assert abs(loads[0] - loads[1]) <= 47
    every = sorted(torch.cat([c for r in found.values() for c, _ in r["Replicated"]]).tolist())
    assert every == index.tolist()
    # Sharded: as many micro-batches on every rank, the short rank's extra ones masked
    assert sorted(len(layouts["Replicated"]) for layouts in found.values()) == [3, 4]
    counts = [len(layouts["Sharded"]) for layouts in found.values()]
    assert counts[0] == counts[1] == max(len(r["Replicated"]) for r in found.values())
    for layouts in found.values():
        for chunk, real in layouts["Sharded"][len(layouts["Replicated"]) :]:
            assert real == 0 and len(chunk) == 1


def test_without_a_budget_the_rows_are_as_by_count(monkeypatch):
    tokens = torch.tensor([47, 9, 10, 8, 43])
    index = torch.arange(5)

    def listed(rows):
        return [(chunk.tolist(), real) for chunk, real in rows]

    assert listed(OneProcess().rows(index, 2, tokens, 0)) == [([0, 1], 2), ([2, 3], 2), ([4], 1)]
    monkeypatch.setattr(dist, "get_world_size", lambda group: WORLD)
    monkeypatch.setattr(dist, "get_rank", lambda group: 1)
    assert listed(Replicated(object()).rows(index, 2, tokens, 0)) == [([1, 3], 2)]
    assert listed(Sharded(object()).rows(index, 1, tokens, 0)) == [([1], 1), ([3], 1), ([1], 0)]


def test_a_negative_budget_is_refused():
    with pytest.raises(ConfigError, match="trainer.max_tokens_per_micro: -1 is out of range"):
        build_config({"trainer.max_tokens_per_micro": -1})
    assert build_config({}).trainer.max_tokens_per_micro == 0


def test_the_budget_reaches_the_update_settings():
    config = build_config({"trainer.max_tokens_per_micro": 4096})
    assert update_settings(config).max_tokens_per_micro == 4096
    assert update_settings(build_config({})).max_tokens_per_micro == 0


# --- the update's gradient -------------------------------------------------------------------


@pytest.mark.parametrize("loss_agg", MODES)
def test_a_token_budget_split_gives_the_whole_mini_batch_gradient(mixed, loss_agg):
    """Float32 tolerance 1e-6: the same per-token terms, summed in another grouping and order
    (micro-batches of other widths), differ by rounding alone (~1e-7 of values near 1)."""
    _, model, experience = mixed
    batch = experience[0]
    whole_settings = settings_for(loss_agg, len(batch))
    budget_settings = dataclasses.replace(whole_settings, max_tokens_per_micro=BUDGET)
    split = OneProcess().rows(torch.arange(len(batch)), 0, row_tokens(batch), BUDGET)
    assert row_tokens(batch).tolist() == TOKENS
    assert [len(chunk) for chunk, _ in split] == [1, 1, 2, 2, 3, 3]  # rows by tokens

    original = {k: v.detach().clone() for k, v in model.named_parameters()}
    whole, whole_metrics = sgd_step(model, experience, whole_settings)
    budget, budget_metrics = sgd_step(model, experience, budget_settings)
    assert max(float((whole[k] - original[k]).abs().max()) for k in original) > 1e-3
    for name in original:
        torch.testing.assert_close(budget[name], whole[name], atol=1e-6, rtol=0)
    assert (whole_metrics["perf/micro_batches"], budget_metrics["perf/micro_batches"]) == (1, 6)
    assert budget_metrics["perf/token_imbalance"] == 1.0  # one process
    for name, value in whole_metrics.items():
        if not name.startswith(("perf/", "memory/")):
            assert budget_metrics[name] == pytest.approx(value, abs=1e-5), name


def _update(model_dir: str, strategy: str, loss_agg: str, group) -> tuple[dict, dict]:
    """One budget-split update of a fresh policy laid out by ``strategy`` over ``group``
    (None: one process); its whole weights and metrics."""
    policy = _policy(model_dir, strategy, group)
    plain = _policy(model_dir, strategy, None).module  # the experience, made alike everywhere
    batch, advantages, old, ref = make_experience(plain, MIXED_LENGTHS)
    settings = dataclasses.replace(settings_for(loss_agg, 64), max_tokens_per_micro=BUDGET)
    metrics = update_policy(policy, batch, advantages, settings, old_logprobs=old, ref_logprobs=ref)
    return {name: t.clone() for name, t in policy.whole_tensors()}, metrics


def _on_rank(model_dir: str) -> dict:
    return {
        (strategy, mode): _update(model_dir, strategy, mode, dist.group.WORLD)
        for strategy in ("replicate", "fsdp")
        for mode in MODES
    }


@pytest.mark.slow  # gloo ranks spawned, each importing torch
def test_two_ranks_with_a_token_budget_end_where_one_process_does(mixed, tmp_path):
    """Replicated and sharded ranks, each mode: the weights and metrics of one process
    (tolerance as test_data_parallel.py's: the same sums, reduced across ranks)."""
    model_dir, _, (batch, *_) = mixed
    mean = float(row_tokens(batch).sum()) / WORLD
    alone = {mode: _update(model_dir, "fsdp", mode, None) for mode in MODES}
    ranks = on_ranks(_on_rank, str(tmp_path / "rank"), WORLD, model_dir)
    for (strategy, mode), _ in ranks[0].items():
        want, want_metrics = alone[mode]
        micro_batches = [found[strategy, mode][1]["perf/micro_batches"] for found in ranks]
        assert micro_batches == [4, 4]  # the most any rank ran (3 and 4), on both
        for found in ranks:
            weights, metrics = found[strategy, mode]
            for name, tensor in weights.items():
                torch.testing.assert_close(tensor, want[name], atol=1e-6, rtol=1e-5)
            for name, value in want_metrics.items():
                if not name.startswith(("perf/", "memory/")):
                    assert metrics[name] == pytest.approx(value, rel=1e-4, abs=1e-6), name
            # the ranks' tokens within the longest row of each other: max / mean bounded
            longest = float(row_tokens(batch).max())
            assert 1.0 <= metrics["perf/token_imbalance"] <= 1 + longest / mean
