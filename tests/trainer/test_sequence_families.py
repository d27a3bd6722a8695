"""Every mixture-of-experts family of the installed transformers under Ulysses sequence
parallelism: two gloo ranks sharing each sequence compute one process's logprobs, loss and
gradients (with a replayed routing plan where the family's routers replay exactly, through
the packed forward too where it takes the family), or the family is refused in one line
before anything runs. A family that is not refused and differs (a hybrid's linear-attention
or Mamba layers see only their rank's slice; a sparse-attention indexer reads the whole
sequence) fails here.

The tiny models are ``tests/models/moe_families.py``'s. Logprobs and loss within
``test_sequence_parallel.py``'s tolerance: float32, the ranks' matmuls on other shapes. Each
parameter's summed gradient within 1e-5 of its tensor's largest entry (and 1e-4 relative):
an entry is a sum of terms as large as that tensor's largest, which may cancel (DBRX's
embedding gradient reaches 26 where most entries are under 1), and float32 sums taken in
another order differ in proportion to the terms, not to what is left after cancelling. The
ranks stay within 0.17 of that tolerance on every family under AVX-512, AVX2 and no-SIMD
kernels, one thread or two; a plan with one response token's expert changed in one layer
moves some comparison of every family that replays by 340 to 64,000 times it."""

import random

import pytest
import torch
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from honing.models.moe import routers_of
from honing.trainer import batch as batch_module
from honing.trainer.batch import collate, response_logprobs
from honing.trainer.ulysses.packed import shared_logprobs
from honing.trainer.ulysses.parallel import SequenceGroup, check_model, use_ulysses
from honing.types import Rollout
from tests.models.moe_families import build, moe_families
from tests.trainer.ranks import on_ranks

from .test_sequence_parallel import _grads

WORLD = 2
FAMILIES = moe_families()
PAD = 0
# What a family may do to its logits after the head: set off 1 (or off) where its config has it
HEAD_KNOBS = {"logits_scaling": 4.0, "final_logit_softcapping": 3.0, "logit_scale": 0.25}
# The families sequence parallelism takes (19 of transformers 5.19's 51; where transformers
# has them): one taken or refused otherwise fails, so a new one is added here deliberately
TAKEN = (
    "aria_text",
    "axk1",
    "dbrx",
    "deepseek_v2",
    "deepseek_v3",
    "ernie4_5_moe",
    "flex_olmo",
    "glm4_moe",
    "glm4_moe_lite",
    "hunyuan_v1_moe",
    "hy_v3",
    "jetmoe",
    "longcat_flash",
    "minimax_m2",
    "minimax_m3_vl_text",
    "olmoe",
    "qwen2_moe",
    "qwen3_moe",
    "solar_open",
)


def _batch():
    """Two rows of 15 and 13 tokens (prompts 6 and 4), ids under the tiny vocabulary."""
    rng = random.Random(0)
    rollouts = [
        Rollout(
            f"p{i}",
            0,
            [rng.randrange(3, 128) for _ in range(prompt)],
            [rng.randrange(3, 128) for _ in range(response)],
            [-1.0] * response,
            "length",
            0,
            "",
        )
        for i, (prompt, response) in enumerate([(6, 9), (4, 9)])
    ]
    return collate(rollouts, pad_id=PAD, device=torch.device("cpu"))


def _plan(batch, routers, one_changed: bool = False) -> torch.Tensor:
    """A random [B, P + R, L, k] choice of distinct experts for every token: no live choice,
    whose near-ties the ranks' other blocking could move (``test_sequence_routing``'s plan
    leaves some tokens live and compares its records with a tolerance). ``one_changed``:
    row 0's first response token sent to another expert in the first MoE layer."""
    gen = torch.Generator().manual_seed(2)
    shape = (*batch.input_ids.shape, routers.layers, routers.num_experts)
    plan = torch.rand(shape, generator=gen).argsort(-1)[..., : routers.top_k]
    if one_changed:
        chosen = set(plan[0, 6, 0].tolist())
        plan[0, 6, 0, 0] = min(set(range(routers.num_experts)) - chosen)
    return plan.to(routers.index_dtype)


def _pass(family: str, packed: bool, sp: SequenceGroup | None, one_changed: bool = False) -> dict:
    """Logprobs, loss and gradients of one pass with a backward (``sp`` None: one process)."""
    model = build(family)
    batch = _batch()
    routers = routers_of(model)
    if routers is not None and routers.check_replay() is None:
        batch.replay = _plan(batch, routers, one_changed)
    if sp is None:
        logprobs, _ = response_logprobs(model, batch, packed=packed)
        logprobs = logprobs * batch.response_mask
    else:
        logprobs, _ = shared_logprobs(use_ulysses(model, sp.world), batch, sp, packed=packed)
    loss = -(logprobs * torch.linspace(0.5, 1.5, logprobs.shape[1])).sum()
    loss.backward()
    return {"logprobs": logprobs.detach(), "loss": loss.detach(), "grads": _grads(model)}


def _family(family: str, sp: SequenceGroup) -> dict | str:
    """Both passes of ``family`` on this rank, or the one-line refusal."""
    try:
        check_model(build(family), sp.world)
    except ValueError as refusal:
        return str(refusal)
    return {packed: _pass(family, packed, sp) for packed in (False, True)}


def _all_families() -> dict:
    sp = SequenceGroup.of()
    return {family: _family(family, sp) for family in FAMILIES}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return on_ranks(_all_families, str(tmp_path_factory.mktemp("sp_families") / "rank"), WORLD)


def _assert_grads(parts: list[dict], want: dict) -> None:
    """The gradients of ``parts`` (one per rank) summed, against one process's ``want``."""
    assert want["grads"].keys() == parts[0]["grads"].keys()
    for name, grad in want["grads"].items():
        total = sum(part["grads"][name] for part in parts)
        scale = float(grad.abs().max())
        torch.testing.assert_close(total, grad, atol=1e-5 * scale, rtol=1e-4, msg=name)


@pytest.mark.slow  # gloo ranks spawned, each building every family
@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_shares_a_sequence_as_one_process_or_is_refused(ranks, family):
    found = [rank[family] for rank in ranks]
    if isinstance(found[0], str):
        assert family not in TAKEN, found[0]
        assert found[0] == found[1] and "\n" not in found[0] and found[0]
        return
    assert family in TAKEN, f"{family} is taken: add it to TAKEN"
    for packed in (False, True):
        want = _pass(family, packed, None)
        for got in found:
            torch.testing.assert_close(
                got[packed]["logprobs"], want["logprobs"], atol=1e-5, rtol=1e-5
            )
            torch.testing.assert_close(got[packed]["loss"], want["loss"], atol=1e-6, rtol=1e-5)
        _assert_grads([got[packed] for got in found], want)


def test_the_gradient_tolerance_tells_one_replayed_expert_changed():
    """DBRX's embedding gradient reaches 26 (AXK1's too: the largest of the families, so the
    loosest absolute tolerance); a plan with one expert of one response token changed in
    one layer still fails the comparison."""
    want = _pass("dbrx", False, None)
    with pytest.raises(AssertionError):
        _assert_grads([_pass("dbrx", False, None, one_changed=True)], want)


def test_the_families_sequence_parallelism_takes_have_a_plain_head(monkeypatch):
    """The head applied in chunks to the final hidden states gives the model's own logprobs:
    what the families sequence parallelism takes (and the chunked head) rely on."""
    batch, taken = _batch(), []
    for family in FAMILIES:
        default = CONFIG_MAPPING[family]()
        model = build(family, **{k: v for k, v in HEAD_KNOBS.items() if hasattr(default, k)})
        try:
            check_model(model, WORLD)
        except ValueError:
            continue
        taken.append(family)
        with torch.no_grad(), monkeypatch.context() as patch:
            want, _ = response_logprobs(model, batch)
            patch.setattr(batch_module, "HEAD_CHUNK_LOGITS", 4 * 128)  # 4 tokens a chunk
            assert batch_module._chunked_head(model, batch, batch.responses.shape[1]), family
            got, _ = response_logprobs(model, batch)
        mask = batch.response_mask.bool()
        torch.testing.assert_close(got[mask], want[mask], atol=1e-5, rtol=1e-5, msg=family)
    assert taken == [family for family in FAMILIES if family in TAKEN]
