"""Every top-k routed mixture-of-experts causal-LM family of the installed transformers:
honing finds its routers, replays a recorded choice exactly, or refuses replay in one line
that names the family and the reason; and docs/moe.md's table says which, for each family.
A family transformers adds that the table does not name fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import transformers

from honing.config import build_config
from honing.errors import ConfigError
from honing.models.moe import routers_of
from honing.models.moe_stats import RouterStats, moe_metrics
from honing.pipeline.rules import check_policy_routing
from tests.models.moe_families import build, moe_families

DOC = Path(__file__).parents[2] / "docs" / "moe.md"


def doc_table() -> dict[str, tuple[str, str]]:
    """docs/moe.md's family table: model type -> (found, replay) columns."""
    rows = {}
    for line in DOC.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) >= 4 and re.fullmatch(r"`[a-z0-9_]+`", cells[0]):
            rows[cells[0].strip("`")] = (cells[1], cells[2])
    return rows


TABLE = doc_table()
INSTALLED = moe_families()


def test_the_table_names_every_installed_family():
    missing = sorted(set(INSTALLED) - set(TABLE))
    assert not missing, (
        f"transformers {transformers.__version__} has MoE families docs/moe.md's table does "
        f"not name: {missing}; build each in tests/models/moe_families.py and add its row"
    )


def ids(shape, seed=0):
    return torch.randint(3, 100, shape, generator=torch.Generator().manual_seed(seed))


def experts_given(routers, model, replay=None):
    """The experts each block's ``experts`` module was handed per token ([N, L, k], seen
    there rather than through honing's hooks): its index argument, or for a block that runs
    every expert on its score (Llama 4) the experts whose input rows are not all zero."""
    given = []

    def take(module, args):
        if len(args) >= 3 and not args[1].is_floating_point():
            given.append(args[1].reshape(-1, args[1].shape[-1]))
        else:  # [E * N, H] rows: each expert's copy of the tokens, zero where not chosen
            rows = args[0].reshape(routers.num_experts, -1, args[0].shape[-1])
            chosen = rows.abs().sum(-1).ne(0).T  # [N, E]
            given.append(chosen.float().topk(routers.top_k, -1).indices.sort(-1).values)

    with torch.no_grad(), routers.session(replay=replay):  # its hooks first: they steer
        handles = [block.experts.register_forward_pre_hook(take) for block in routers.blocks]
        try:
            model(ids((2, 7)))
        finally:
            for handle in handles:
                handle.remove()
    return torch.stack(given, 1)


def one_choice_changed(plan: torch.Tensor, hashed: list[bool], routers) -> torch.Tensor:
    """``plan`` [N, L, k] with token 0's first expert in the first layer routed by its logits
    replaced by the lowest-numbered expert that token was not sent to there."""
    plan = plan.clone()
    layer = hashed.index(False)
    taken = set(plan[0, layer].tolist())
    plan[0, layer, 0] = min(set(range(routers.num_experts)) - taken)
    return plan


@pytest.mark.parametrize("family", INSTALLED)
def test_each_family_is_replayed_exactly_or_refused_in_one_line(family):
    found, replay = TABLE.get(family, ("?", "?"))
    if found == "?":
        pytest.fail(f"{family} is not in docs/moe.md's table")
    model = build(family)
    routers = routers_of(model)
    config = build_config({"algorithm.routing_replay": "R3"})
    if found.startswith("no"):
        assert routers is None
        with pytest.raises(ConfigError, match=f"the {family} family .*; set "):
            check_policy_routing(config, model)
        return
    assert routers is not None and routers.layers >= 1 and found.startswith("yes")
    # metrics: every decision counted in a slot (a looped layer's on every pass), the
    # entropy positive; none where the routers' choice cannot be read (named below)
    stats = RouterStats()
    with torch.no_grad(), routers.session(stats=stats, record=True, probe=True) as session:
        plain = model(ids((2, 7))).logits
    if not session.unread:
        sums = {k: float(v) for k, v in stats.sums().items()}
        loads = sum(v for k, v in sums.items() if k.startswith("load/"))
        decisions = 14 * routers.top_k
        assert loads % decisions == 0 and loads >= decisions * routers.layers
        metrics = moe_metrics(sums, routers.layers, routers.num_experts, routers.null_experts)
        assert metrics["moe/router_entropy"] > 0
    reason = routers.check_replay()
    if not replay.startswith("exact") or f"refused on {transformers.__version__}" in replay:
        assert reason is not None and family in reason and "\n" not in reason
        with pytest.raises(ConfigError, match=re.escape(reason)):
            check_policy_routing(config, model)
        return
    assert reason is None
    check_policy_routing(config, model)
    # the routers' own choice replayed: their own weights, so the same logits bit for bit on
    # any CPU's kernels; one choice changed (token 0's first expert, in a layer that routes
    # by its logits) changes them, so the equality is not that of a replay left unapplied
    hashed = [routers.adapter.hashed(router) for router in routers.routers]
    [recorded] = session.recorded_calls()
    with torch.no_grad():
        with routers.session(replay=recorded.long()):
            again = model(ids((2, 7))).logits
        with routers.session(replay=one_choice_changed(recorded.long(), hashed, routers)):
            changed = model(ids((2, 7))).logits
    assert torch.equal(plain, again), "replaying the routers' own choice changed the logits"
    assert not torch.equal(plain, changed), "a replayed choice of another expert was not used"
    # the recipe, which weighs a token routed elsewhere than its router chose, gives the
    # routers' weights of their own choice to float32 rounding: the same formula, where an
    # element-wise score may be rounded at another place of a vectorised loop (1 ulp), then
    # divided by a sum of k such and scaled (a few ulps in all)
    for number, [(logits, weights, live)] in enumerate(session.seen):
        if not hashed[number]:
            recipe = routers.mixing_of(number, (logits, weights, live))
            recomputed = recipe.weights(logits, live, weights.dtype)
            torch.testing.assert_close(recomputed, weights, rtol=1e-6, atol=0)
    # another choice (each expert number moved by one) reaches the experts as planned
    plan = (recorded.long() + 1) % routers.num_experts
    given = experts_given(routers, model, replay=plan)
    for layer in range(routers.layers):
        expected = recorded[:, layer] if hashed[layer] else plan[:, layer]
        assert torch.equal(given[:, layer].sort(-1).values, expected.sort(-1).values.long())
    assert not torch.equal(experts_given(routers, model)[:, ~torch.tensor(hashed)], given)


@pytest.mark.parametrize("family", [f for f in ("longcat_flash", "zaya") if f in INSTALLED])
def test_zero_and_skip_experts_are_counted_as_null_slots(family):
    """LongCat-Flash's zero experts and ZAYA's skip (which its router hands on as expert 0
    with weight 0) are counted in slots after the experts, not dropped nor put on an
    expert; a replayed skip reaches the block folded as the router folds it."""
    model = build(family)
    routers = routers_of(model)
    stats = RouterStats()
    with torch.no_grad(), routers.session(stats=stats, record=True) as session:
        model(ids((4, 16)))
    if session.unread:  # transformers 5.16.1's LongCat router returns no logits (the table)
        assert f"refused on {transformers.__version__}" in TABLE[family][1]
        return
    [recorded] = session.recorded_calls()
    null = recorded >= routers.num_experts
    assert null.any() and int(recorded.max()) < routers.slots
    assert stats.load[:, routers.num_experts :].sum() == null.sum()
    sums = {k: float(v) for k, v in stats.sums().items()}
    share = moe_metrics(sums, routers.layers, routers.num_experts, routers.null_experts)
    assert share["moe/null_expert_share"] == pytest.approx(float(null.float().mean()))
    with torch.no_grad():  # replaying the record, null slots included, changes nothing
        with routers.session():
            plain = model(ids((4, 16))).logits
        with routers.session(replay=recorded.long()):
            assert torch.equal(model(ids((4, 16))).logits, plain)
