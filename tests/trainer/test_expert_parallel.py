"""Expert parallelism: two gloo ranks, each holding half the experts of a tiny MoE model and
feeding its own rows, compute what one process computes on the rows of both: the logprobs,
each rank's expert gradients (the matching slice of one process's) and the dense gradients
(summed over the ranks), with routing replay dispatching the replayed experts, on the
model's own forward and honing's packed one; and the one-line refusals. The split and
permutation arithmetic is checked in one process.

Tolerance: float32. The experts see the same rows as in one process, but the top-k sum and
the gradients' sums run in another order (a rank's rows, then the other's), so agreement is
to float32 reassociation (atol 1e-5), not bit for bit."""

import pytest
import torch
import torch.distributed as dist

from honing.errors import ConfigError
from honing.models.moe import routers_of
from honing.trainer import expert_parallel
from honing.trainer.batch import collate, response_logprobs
from honing.trainer.expert_parallel import (
    apply_expert_parallel,
    check_expert_parallel,
    inverse,
    local,
    local_order,
    route,
)
from honing.trainer.layouts import copy_whole, whole_pieces
from honing.types import Rollout
from tests.models.moe_families import build, moe_families
from tests.models.moe_models import moe_model
from tests.trainer.ranks import on_ranks

WORLD = 2
VOCAB, PAD = 64, 0
ROWS, TOKENS = 2, 8  # per rank
# (family, what the pass does): "live" routes as the routers choose, "replay" by a plan,
# "loop" runs the local experts one by one instead of grouped_mm
CASES = (
    ("qwen3_moe", "live"),  # a dense layer among the MoE ones
    ("qwen3_moe", "replay"),
    ("qwen3_moe", "loop"),
    ("mixtral", "replay"),  # 4 experts, 2 per rank
    ("deepseek_v3", "live"),  # group-limited sigmoid routing, a shared expert
    ("qwen2_moe", "live"),  # 6 experts, 3 per rank; a gated shared expert
    ("gpt_oss", "live"),  # transposed, interleaved gate and up, biases
    ("gpt_oss", "loop"),
    ("nemotron_h", "live"),  # no gate: up_proj and an activation
)
# not transformers' fused experts (DBRX: 2-D weights; Llama 4: every expert on every token;
# LongCat-Flash: zero experts among its weights), or no routers honing reads
REFUSED = ("dbrx", "llama4_text", "longcat_flash", "doge", "jetmoe")


def _model(family: str):
    if family in ("gpt_oss", "nemotron_h"):
        return build(family, vocab_size=VOCAB)
    return moe_model(family, VOCAB, PAD).float()


def _ids() -> torch.Tensor:
    """[WORLD * ROWS, TOKENS]: rank r feeds rows r * ROWS .. (r + 1) * ROWS - 1."""
    return torch.randint(
        1, VOCAB, (WORLD * ROWS, TOKENS), generator=torch.Generator().manual_seed(0)
    )


def _plan(routers) -> torch.Tensor:
    """[WORLD * ROWS * TOKENS, L, k] distinct random experts, every fifth token -1 (live)."""
    gen = torch.Generator().manual_seed(2)
    shape = (WORLD * ROWS * TOKENS, routers.layers, routers.num_experts)
    plan = torch.rand(shape, generator=gen).argsort(-1)[..., : routers.top_k]
    plan[::5] = -1
    return plan


def _pass(model, ids: torch.Tensor, plan: torch.Tensor | None) -> dict:
    """The logprobs of ``ids`` (routed by ``plan`` if given), the backward of their negated
    sum, and the experts each layer used."""
    with routers_of(model).session(replay=plan, record=True) as session:
        logits = model(input_ids=ids).logits.float()
    logprobs = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
    (-logprobs.sum()).backward()
    grads = {  # an expert-parallel rank's experts: its shard
        name: local(p.grad).clone() for name, p in model.named_parameters() if p.grad is not None
    }
    return {"logprobs": logprobs.detach(), "grads": grads, "used": session.recorded_calls()[0]}


def _one_process(family: str, plans: str) -> dict:
    model = _model(family)
    plan = _plan(routers_of(model)) if plans == "replay" else None
    return _pass(model, _ids(), plan) | {"params": dict(model.named_parameters())}


def _on_rank(family: str, plans: str) -> dict:
    rank = dist.get_rank()
    model = _model(family)
    whole = {name: p.detach().clone() for name, p in model.named_parameters()}
    shards = apply_expert_parallel(model, dist.group.WORLD)
    rows = slice(rank * ROWS, (rank + 1) * ROWS)
    plan = None
    if plans == "replay":  # the rows of this rank's tokens
        plan = _plan(routers_of(model))[rank * ROWS * TOKENS : (rank + 1) * ROWS * TOKENS]
    fits = expert_parallel.grouped_mm_fits
    if plans == "loop":
        expert_parallel.grouped_mm_fits = lambda *args: False
    try:
        result = _pass(model, _ids()[rows], plan)
    finally:
        expert_parallel.grouped_mm_fits = fits
    counts = torch.stack([m.counts for m in shards.modules.values()])  # [L, ep, E]
    names = shards.parameter_names
    # as the trainer's layouts gather and load them (weight sync, exports, checkpoints)
    params = dict(model.named_parameters())
    gathered = dict(whole_pieces((name, params[name].detach()) for name in names))
    unknown = copy_whole(model, [(names[0], gathered[names[0]] * 2)])
    loaded = local(params[names[0]]).detach().clone()
    return result | {
        "names": names,
        "counts": counts,
        "expert_bytes": shards.expert_bytes(),
        "unknown": unknown,
        "metrics": shards.take_metrics(),
        "after_take": sum(int(m.counts.sum()) for m in shards.modules.values()),
        "whole_equal": all(torch.equal(gathered[n], whole[n]) for n in gathered),
        "loaded": (names[0], loaded),
    }


def _rollouts() -> list[Rollout]:
    """Four samples of other prompt and response lengths; rank r takes 2r and 2r + 1."""
    gen = torch.Generator().manual_seed(1)
    return [
        Rollout(
            prompt_id=f"p{i}",
            group_index=i,
            prompt_ids=torch.randint(1, VOCAB, (prompt,), generator=gen).tolist(),
            response_ids=torch.randint(1, VOCAB, (response,), generator=gen).tolist(),
            behaviour_logprobs=[-1.0] * response,
            finish_reason="length",
            weight_version=0,
            text="",
        )
        for i, (prompt, response) in enumerate([(12, 20), (9, 15), (14, 11), (7, 18)])
    ]


def _packed_logprobs(model, rollouts: list[Rollout]) -> list[torch.Tensor]:
    """Each sample's response logprobs from honing's packed forward (the lean path)."""
    batch = collate(rollouts, pad_id=PAD, device=torch.device("cpu"))
    with torch.no_grad():
        logprobs, _ = response_logprobs(model, batch, packed=True)
    return [logprobs[i, : len(r.response_ids)] for i, r in enumerate(rollouts)]


def _all_cases() -> dict:
    results = {case: _on_rank(*case) for case in CASES}
    model = _model("qwen3_moe")
    apply_expert_parallel(model, dist.group.WORLD)
    results["packed"] = _packed_logprobs(model, _rollouts()[2 * dist.get_rank() :][:2])
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return on_ranks(_all_cases, str(tmp_path_factory.mktemp("ep") / "rank"), WORLD)


@pytest.mark.slow  # gloo ranks spawned, each importing torch
@pytest.mark.parametrize("case", CASES, ids=["-".join(case) for case in CASES])
def test_two_expert_parallel_ranks_compute_what_one_process_computes(ranks, case):
    want = _one_process(*case)
    names = ranks[0][case]["names"]
    assert names and set(names) <= want["grads"].keys()
    whole = torch.cat([rank[case]["logprobs"] for rank in ranks])
    torch.testing.assert_close(whole, want["logprobs"], atol=1e-5, rtol=1e-5)
    for name, grad in want["grads"].items():
        if name in names:  # each rank's experts: its slice of one process's
            local = grad.shape[0] // WORLD
            for r, rank in enumerate(ranks):
                part = grad[r * local : (r + 1) * local]
                torch.testing.assert_close(rank[case]["grads"][name], part, atol=1e-5, rtol=1e-4)
        else:  # dense, routers and shared experts included: summed over the ranks
            total = sum(rank[case]["grads"][name] for rank in ranks)
            torch.testing.assert_close(total, grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in CASES if c[1] == "replay"], ids="-".join)
def test_a_replayed_plan_is_what_is_dispatched(ranks, case):
    """Every expert receives the pairs one process's replay routes to it, from both ranks,
    and the plan moves them off the live choice."""
    want = _one_process(*case)
    used = want["used"].long()  # [N, L, k]: the experts each layer used in one process
    experts = ranks[0][case]["counts"].shape[-1]
    dispatched = [torch.bincount(layer.flatten(), minlength=experts) for layer in used.unbind(1)]
    for rank in ranks:
        assert torch.equal(rank[case]["counts"].sum(1), torch.stack(dispatched))
    live = _one_process(case[0], "live")["used"].long()
    assert (live != used).any()


@pytest.mark.slow
def test_the_packed_forward_runs_on_the_shards(ranks):
    want = _packed_logprobs(_model("qwen3_moe"), _rollouts())
    for got, row in zip(ranks[0]["packed"] + ranks[1]["packed"], want, strict=True):
        torch.testing.assert_close(got, row, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_the_shards_gather_load_and_measure(ranks):
    """Whole tensors are the unsharded model's; a loaded whole tensor lands as this rank's
    slice; the metrics count each layer's dispatch and reset when taken."""
    case = CASES[0]
    params = _one_process(*case)["params"]
    for r, rank in enumerate(ranks):
        got = rank[case]
        assert got["whole_equal"] and got["unknown"] == []
        name, loaded = got["loaded"]
        local = params[name].shape[0] // WORLD
        assert torch.equal(loaded, 2 * params[name].detach()[r * local : (r + 1) * local])
        metrics = got["metrics"]
        held = sum(params[name].numel() for name in got["names"]) // WORLD
        assert got["expert_bytes"] == 4 * held  # float32
        assert 1 <= metrics["ep/load_imbalance/mean"] <= metrics["ep/load_imbalance/max"] <= WORLD
        assert got["after_take"] == 0


def test_refusals_are_one_line():
    refused = {}
    for family in ("dbrx", "llama4_text", "jetmoe"):
        with pytest.raises(ConfigError) as error:
            check_expert_parallel(build(family), WORLD)
        refused[family] = str(error.value)
    for family in ("dbrx", "llama4_text"):
        assert refused[family].startswith(f"trainer.expert_parallel: the {family} family's")
    assert "jetmoe model has no top-k routed" in refused["jetmoe"]
    with pytest.raises(ConfigError) as error:
        check_expert_parallel(moe_model("qwen2_moe", VOCAB, PAD, num_experts=5), WORLD)
    refused["indivisible"] = str(error.value)
    assert refused["indivisible"] == (
        "trainer.expert_parallel=2: the qwen2_moe model's 5 experts do not divide among 2 ranks"
    )
    assert all("\n" not in message for message in refused.values())


@pytest.mark.slow  # builds every family (shared with tests/models/test_moe_families.py)
def test_every_family_with_fused_experts_is_taken_and_the_others_refused():
    """The families docs/moe.md names as refused are the ones refused, on the installed
    transformers: every other family's experts are the fused layout this shards."""
    refused = set()
    for family in moe_families():
        try:
            check_expert_parallel(build(family), WORLD)
        except ConfigError:
            refused.add(family)
    assert refused == set(REFUSED) & set(moe_families())


def _simulated(experts_by_rank: list[torch.Tensor], num_experts: int) -> list[torch.Tensor]:
    """The dispatch and combine of ``ExpertParallelExperts.forward`` with the exchanges done
    by hand: each rank's [S] pairs' experts in, each pair's output out, where an expert's
    output for a pair is 1000 * expert + (rank, pair) tagged as it was sent."""
    ep = len(experts_by_rank)
    local = num_experts // ep
    routes = [route(experts, num_experts) for experts in experts_by_rank]
    matrix = torch.stack([counts for _, counts in routes])  # [ep, E]
    send = [matrix[r].view(ep, local).sum(1).tolist() for r in range(ep)]
    rows = [  # what each pair carries: 10 * its pair number + its rank
        (10 * order[: sum(send[r])] + r).double() for r, (order, _) in enumerate(routes)
    ]
    pieces = [list(rows[r].split(send[r])) for r in range(ep)]
    outs = []
    for dest in range(ep):
        arrived = torch.cat([pieces[src][dest] for src in range(ep)])
        regroup, sizes = local_order(matrix[:, dest * local : (dest + 1) * local])
        expert = torch.repeat_interleave(torch.arange(local) + dest * local, sizes)
        outs.append((arrived[regroup] + 1000 * expert)[inverse(regroup)])
    back = [
        list(out.split(matrix[:, d * local : (d + 1) * local].sum(1).tolist()))
        for d, out in enumerate(outs)
    ]
    results = []
    for r, (order, _) in enumerate(routes):
        returned = torch.cat([back[dest][r] for dest in range(ep)])
        dropped = torch.full((order.numel() - returned.numel(),), -1.0, dtype=torch.double)
        results.append(torch.cat([returned, dropped])[inverse(order)])
    return results


def test_the_dispatch_arithmetic_brings_every_pair_back_from_its_expert():
    gen = torch.Generator().manual_seed(0)
    experts = [torch.randint(-1, 9, (size,), generator=gen) for size in (30, 0, 17, 5)]
    for r, (pairs, out) in enumerate(zip(experts, _simulated(experts, 8), strict=True)):
        valid = (pairs >= 0) & (pairs < 8)
        want = 1000 * pairs + 10 * torch.arange(pairs.numel()) + r
        assert torch.equal(out[valid], want[valid].double())
        assert (out[~valid] == -1).all()  # null slots are never sent


def test_local_order_groups_arrivals_by_expert_then_source():
    received = torch.tensor([[2, 0, 1], [1, 3, 0]])  # [ep, El]
    regroup, sizes = local_order(received)
    # arrivals: rank 0's e0 e0 e2, rank 1's e0 e1 e1 e1
    assert regroup.tolist() == [0, 1, 3, 4, 5, 6, 2]
    assert sizes.tolist() == [3, 3, 1]
    order, counts = route(torch.tensor([3, -1, 0, 3, 8, 1]), 4)
    assert order.tolist()[:4] == [2, 5, 0, 3] and counts.tolist() == [1, 1, 0, 2]
