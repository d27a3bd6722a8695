"""A mixture-of-experts policy under Ulysses sequence parallelism: two gloo ranks share each
sequence, and what the routers give the trainer (the experts they used, the statistics, the
router losses' logits) and what they take from it (a replayed plan, the rollout's choice to
compare with) is one process's: the logprobs, the router losses, the summed gradients, the
recorded experts and the statistics, on the model's own forward and the packed one, for the
five families of ``tests/models/moe_models.py`` (DeepSeek-V3: multi-head latent attention,
group-limited routing; Qwen2-MoE: a gated shared expert).

Tolerance: float32 logprobs, losses and gradients as ``test_sequence_parallel.py`` (the
ranks' matmuls run on other shapes; ~1e-6 relative). Routing decisions are integers, but a
router's logits in another blocking can move a near-tie to the other side: at most 0.5% of
the decisions may differ (a misplaced or misordered gather differs in most of them)."""

import pytest
import torch

from honing.models.moe import routers_of
from honing.models.moe_stats import RouterStats, router_z_loss
from honing.trainer.batch import RouterTap, response_logprobs
from honing.trainer.ulysses.packed import shared_logprobs
from honing.trainer.ulysses.parallel import SequenceGroup, use_ulysses
from tests.models.moe_models import moe_model
from tests.trainer.ranks import on_ranks

from .test_sequence_parallel import PAD, VOCAB, _batch, _batch_loss, _grads

WORLD = 2
# (family, packed forward, what the batch plans): "record" takes the experts the pass used
# and compares the live choice with a rollout's; "replay" routes as a plan says
CASES = (
    ("qwen3_moe", False, "record"),
    ("qwen3_moe", True, "record"),
    ("qwen3_moe", True, "replay"),
    ("deepseek_v3", False, "replay"),
    ("mixtral", True, "record"),
    ("qwen2_moe", False, "record"),
    ("olmoe", False, "replay"),
)


def _plan(batch, routers, seed: int) -> torch.Tensor:
    """A random [B, P + R, L, k] choice of distinct experts, every fifth token -1 (none)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (*batch.input_ids.shape, routers.layers, routers.num_experts)
    plan = torch.rand(shape, generator=gen).argsort(-1)[..., : routers.top_k]
    plan[:, ::5] = -1
    return plan.to(routers.index_dtype)


def _case(family: str, packed: bool, plans: str, sp: SequenceGroup | None) -> dict:
    """One pass with gradient of the case's model and batch (``sp`` None: one process) and
    the loss's backward: logprobs, loss, gradients, what the tap took."""
    model = moe_model(family, VOCAB, PAD).float()
    routers = routers_of(model)
    batch = _batch()
    if plans == "record":
        batch.rollout_routing = _plan(batch, routers, 1)
    else:
        batch.replay = _plan(batch, routers, 2)
    tap = RouterTap(stats=RouterStats(), record=plans == "record", keep_logits=True)
    options = {"packed": packed, "tap": tap, "with_entropy": True, "entropy_grad": True}
    if sp is None:
        logprobs, entropy = response_logprobs(model, batch, **options)
    else:
        logprobs, entropy = shared_logprobs(use_ulysses(model, sp.world), batch, sp, **options)
    mask = batch.response_mask
    logprobs, entropy = logprobs * mask, entropy * mask  # the model's own leaves padding's in
    losses = {"z": router_z_loss(tap.logits)}
    balance = routers.load_balancing_loss()
    if balance is not None:
        losses["aux"] = balance(tuple(tap.logits), routers.num_experts, routers.top_k)
    loss = _batch_loss(logprobs, entropy, batch) + 0.1 * sum(losses.values())
    loss.backward()
    return {
        "logprobs": logprobs.detach(),
        "loss": loss.detach(),
        "router_losses": {name: value.detach() for name, value in losses.items()},
        "grads": _grads(model),
        "recorded": tap.recorded,
        "stats": tap.stats,
    }


def _all_cases() -> dict:
    sp = SequenceGroup.of()
    return {case: _case(*case, sp) for case in CASES}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return on_ranks(_all_cases, str(tmp_path_factory.mktemp("sp_moe") / "rank"), WORLD)


def _differing(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got != want).float().mean())


@pytest.mark.slow  # gloo ranks spawned, each importing torch
@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, case)) for case in CASES])
def test_two_ranks_route_a_shared_sequence_as_one_process_does(ranks, case):
    want = _case(*case, None)
    _, _, plans = case
    for rank in ranks:
        got = rank[case]
        torch.testing.assert_close(got["logprobs"], want["logprobs"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got["loss"], want["loss"], atol=1e-6, rtol=1e-5)
        for name, value in want["router_losses"].items():  # over the slot's every token
            torch.testing.assert_close(got["router_losses"][name], value, atol=1e-6, rtol=1e-5)
        if plans == "record":  # padding's experts are its own: what it sees differs
            assert got["recorded"].shape == want["recorded"].shape
            real = _batch().attention_mask.bool()
            assert _differing(got["recorded"][real], want["recorded"][real]) <= 0.005
        mine, whole = got["stats"], want["stats"]
        assert torch.equal(mine.tokens, whole.tokens)  # every real token counted once
        assert torch.equal(mine.compared, whole.compared)
        assert whole.compared.sum() > 0 if plans == "record" else whole.compared.sum() == 0
        load = (mine.load - whole.load).abs().sum() / whole.load.sum()
        assert load <= 0.005, float(load)
        matched = (mine.matched - whole.matched).abs().sum() / whole.tokens.sum()
        assert matched <= 0.005, float(matched)
        torch.testing.assert_close(mine.entropy, whole.entropy, rtol=1e-5, atol=1e-6)
    assert want["grads"].keys() == ranks[0][case]["grads"].keys()
    for name, grad in want["grads"].items():
        parts = [rank[case]["grads"][name] for rank in ranks]
        torch.testing.assert_close(sum(parts), grad, atol=1e-5, rtol=1e-4, msg=name)
    routers = [name for name in want["grads"] if name.endswith("mlp.gate.weight")]
    assert routers and all(  # both ranks' tokens reach every router
        ranks[r][case]["grads"][name].abs().max() > 0 for r in range(WORLD) for name in routers
    )


@pytest.mark.slow
def test_a_replayed_plan_changes_what_the_pass_computes():
    """The replay cases' equality says something: the plan moves the logprobs."""
    live = moe_model("qwen3_moe", VOCAB, PAD).float()
    batch = _batch()
    with torch.no_grad():
        before, _ = response_logprobs(live, batch)
        batch.replay = _plan(batch, routers_of(live), 2)
        after, _ = response_logprobs(live, batch)
    assert float(((after - before) * batch.response_mask).abs().max()) > 1e-2
