"""Mixture-of-experts policies: the routers of every family, routing replay, the MoE fast
paths against the models' own forward, router losses and the routing metrics."""

import pytest
import torch

from honing.models.llama_block import supports
from honing.models.moe import routers_of
from honing.models.moe_mixing import find_mixing
from honing.models.moe_stats import RouterStats, moe_metrics
from honing.rollout.base import GenerationRequest, SamplingParams
from honing.rollout.native.engine import TransformersEngine
from honing.rollout.native.fast_decode import FastDecoder
from honing.trainer.batch import RouterTap, collate, response_logprobs
from honing.trainer.engine import TrainedModule
from honing.trainer.layouts import OneProcess
from honing.trainer.policy_update import UpdateSettings, update_policy
from tests.models.moe_models import FAMILIES, moe_model
from tests.trainer.test_packed import BATCHES, grpo_like_batch

CPU = torch.device("cpu")
VOCAB, PAD = 64, 0
FAST = ("qwen3_moe", "qwen2_moe", "mixtral")  # the families the lean paths take


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def model(family):
    return moe_model(family, VOCAB, PAD)


@pytest.fixture(scope="module")
def batch():
    return grpo_like_batch(VOCAB, PAD)


def test_every_family_s_routers_are_found_and_their_mixing_recomputed(family, model):
    routers = routers_of(model)
    layers = {"qwen3_moe": 2, "deepseek_v3": 2}.get(family, 3)  # a dense layer in those two
    assert routers.layers == layers and routers.top_k == 2
    assert routers.check_replay() is None
    recipes = {(r.score, r.scale) for r in routers.mixing.values()}
    assert recipes == ({("sigmoid", 2.5)} if family == "deepseek_v3" else {("softmax", 1.0)})


def test_a_router_no_recipe_reproduces_cannot_be_replayed(model):
    routers = routers_of(model)
    router, block = routers.routers[0], routers.blocks[0]
    logits, weights, experts = router(torch.randn(3, model.config.hidden_size))
    candidates = routers.adapter.recipes(router, block, model.config)
    assert find_mixing(candidates, (logits, weights, experts)) is not None
    assert find_mixing(candidates, (logits, weights * 1.5, experts)) is None


def test_replaying_the_routers_own_choice_changes_nothing(family, model, batch):
    """The recipe found reproduces every family's weights bit for bit: replaying what the
    routers chose gives the logprobs of the plain forward exactly."""
    with torch.no_grad():
        tap = RouterTap(record=True)
        plain, _ = response_logprobs(model, batch, tap=tap)
        batch.replay = tap.recorded
        try:
            replayed, _ = response_logprobs(model, batch)
        finally:
            batch.replay = None
    assert torch.equal(plain, replayed)


def sample(model, *, fast: bool, greedy: bool = False, n: int = 3):
    engine = TransformersEngine(model, _Tokenizer(), device=CPU, fast_decode=fast)
    requests = [
        GenerationRequest("a", [5, 6, 7, 8, 9], 0),
        GenerationRequest("b", [10, 11], 1),
    ]
    params = SamplingParams(n=n, max_new_tokens=6, max_seq_len=32, greedy=greedy, seed=3)
    return engine.generate(requests, params)


class _Tokenizer:
    pad_token_id, eos_token_id = PAD, 1

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def test_each_rollout_carries_its_tokens_experts(model):
    for rollout in sample(model, fast=supports(model) is True):
        experts = rollout.routed_experts
        assert experts.dtype == torch.int8
        expected = (len(rollout.prompt_ids) + len(rollout.response_ids) - 1, *_shape(model))
        assert tuple(experts.shape) == expected


def _shape(model):
    routers = routers_of(model)
    return routers.layers, routers.top_k


@pytest.mark.parametrize("packed", [False, True])
def test_replay_reproduces_the_rollouts_choice_in_the_trainer(packed):
    """R3: after the policy moved, the trainer's forward picks other experts for some tokens;
    with the rollout's experts replayed it uses exactly the rollout's, in every layer, on the
    padded and the packed forward. Dropping the replay fails the test (checked below)."""
    model = moe_model("qwen3_moe", VOCAB, PAD)
    rollouts = sample(model, fast=True)
    moved = moe_model("qwen3_moe", VOCAB, PAD)
    with torch.no_grad():
        for router in routers_of(moved).routers:  # an update's worth of router change
            router.weight.add_(torch.randn_like(router.weight) * 0.05)
    batch = collate(rollouts, PAD, CPU)
    recorded = batch.rollout_routing
    known = recorded[:, :, 0, 0] >= 0  # [B, P + R]: the positions the rollout ran
    assert int(known.sum()) == sum(len(r.routed_experts) for r in rollouts)

    def used(replay):
        """The experts each MoE block's ``experts`` module was given (seen there, not
        through honing's hooks), in the batch layout."""
        batch.replay = recorded if replay else None
        tap = RouterTap(record=True, stats=RouterStats())
        given = []
        handles = [
            block.experts.register_forward_pre_hook(lambda m, args: given.append(args[1]))
            for block in routers_of(moved).blocks
        ]
        try:
            with torch.no_grad():
                response_logprobs(moved, batch, packed=packed, tap=tap)
        finally:
            for handle in handles:
                handle.remove()
        assert len(given) == 2
        flat = torch.stack(given, 1).to(recorded.dtype)  # [N, L, k] in the forward's order
        if packed:  # the stream's tokens back in their batch places
            layout = batch.layouts[(CPU, torch.float32)]
            out, placed = torch.full_like(recorded.view(-1, 2, 2), -1), layout.places >= 0
            out[placed] = flat[layout.places[placed]]
            flat = out
        stats = {k: float(v) for k, v in tap.stats.sums().items()}
        return flat.view_as(recorded), moe_metrics(stats, 2, 8)

    replayed, stats = used(True)
    assert torch.equal(replayed[known], recorded[known])
    live, _ = used(False)
    assert not torch.equal(live[known], recorded[known])  # what dropping the replay gives
    # the live router disagrees with the rollout on some decisions; the metric says so
    assert 0.5 < stats["moe/rollout_router_match"] < 1.0


@pytest.mark.parametrize("family", FAST)
def test_fast_decode_matches_the_models_own_forward(family):
    model = moe_model(family, VOCAB, PAD)
    ids = torch.randint(3, VOCAB, (3, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        decoder = FastDecoder(model)
        logits = decoder.prefill(ids, mask, positions, 4)
        expected = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        torch.testing.assert_close(logits, expected[:, -1], atol=1e-5, rtol=1e-5)
        token, step = logits.argmax(-1), positions[:, -1:] + 1
        logits = decoder.step(token, step)
        expected = model(
            input_ids=torch.cat([ids, token[:, None]], 1),
            attention_mask=torch.cat([mask, torch.ones_like(mask[:, :1])], 1),
            position_ids=torch.cat([positions, step], 1),
        ).logits
        torch.testing.assert_close(logits, expected[:, -1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", FAST)
def test_greedy_generation_is_token_identical_on_both_paths(family):
    model = moe_model(family, VOCAB, PAD)
    fast, plain = sample(model, fast=True, greedy=True), sample(model, fast=False, greedy=True)
    assert [r.response_ids for r in fast] == [r.response_ids for r in plain]
    for a, b in zip(fast, plain, strict=True):
        assert torch.equal(a.routed_experts, b.routed_experts)


@pytest.mark.parametrize("batch_kind", list(BATCHES))
@pytest.mark.parametrize("family", FAST)
def test_packed_logprobs_and_gradients_match_the_models_own_forward(family, batch_kind):
    """Both packed layouts: groups sharing their prompt, and a causal block per row (rows
    with prompts of their own, or long answers to shared ones)."""
    batch = grpo_like_batch(VOCAB, PAD, *BATCHES[batch_kind])
    model = moe_model(family, VOCAB, PAD).train()
    weights = torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(2))

    def run(packed: bool):
        model.zero_grad(set_to_none=True)
        logprobs, entropy = response_logprobs(
            model, batch, with_entropy=True, entropy_grad=True, packed=packed
        )
        ((logprobs + 0.1 * entropy) * weights * batch.response_mask).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return logprobs.detach(), grads

    (expected, expected_grads), (packed, packed_grads) = run(False), run(True)
    mask = batch.response_mask.bool()
    torch.testing.assert_close(packed[mask], expected[mask], atol=2e-5, rtol=1e-5)
    assert expected_grads.keys() == packed_grads.keys()
    assert any(".gate." in name for name in expected_grads)  # the routers learn too
    for name, grad in expected_grads.items():
        scale = grad.abs().max().clamp(min=1e-6)
        assert (packed_grads[name] - grad).abs().max() / scale < 1e-4, name


@pytest.mark.parametrize(
    "family, reason", [("olmoe", "not Llama-family"), ("deepseek_v3", "not Llama-family")]
)
def test_families_the_lean_paths_do_not_take_say_why(family, reason):
    assert reason in supports(moe_model(family, VOCAB, PAD))


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "olmoe", "qwen2_moe"])
def test_the_load_balancing_loss_is_the_familys_own(family, batch):
    """``moe/aux_loss`` of an update on the padded forward is the model's own ``aux_loss``
    (``output_router_logits``) on the same tokens, and the router gets its gradient."""
    model = moe_model(family, VOCAB, PAD)
    model.config.output_router_logits = True
    with torch.no_grad():
        own = model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids,
        ).aux_loss
    engine = TrainedModule(
        "policy", model, torch.optim.SGD(model.parameters(), lr=0.0), layout=OneProcess()
    )
    settings = UpdateSettings(packed=False, router_aux_coef=0.01, router_z_coef=0.001)
    advantages = torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(0))
    metrics = update_policy(engine, batch, advantages, settings)
    model.config.output_router_logits = False
    assert abs(metrics["moe/aux_loss"] - float(own)) < 1e-5
    assert metrics["moe/z_loss"] > 0
    assert {"moe/load_violation/max", "moe/router_entropy"} <= metrics.keys()


def test_the_load_balancing_loss_is_found_through_fsdps_subclass():
    """FSDP2 makes a sharded model an instance of a class it creates elsewhere
    (``FSDP<Model>``, a subclass of the model's): the loss is still the family's."""
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    model = moe_model("qwen3_moe", VOCAB, PAD)
    model.__class__ = type(f"FSDP{type(model).__name__}", (type(model),), {"__module__": "x"})
    found = routers_of(model).load_balancing_loss()
    assert found is modeling_qwen3_moe.load_balancing_loss_func


def test_load_violation_is_zero_when_balanced_and_experts_minus_one_when_not():
    balanced = {f"load/{e}": 5.0 for e in range(4)} | {"tokens/0": 10.0}
    skewed = {"load/0": 20.0, "tokens/0": 10.0}
    assert moe_metrics(balanced, 1, 4)["moe/load_violation/max"] == 0.0
    assert moe_metrics(skewed, 1, 4)["moe/load_violation/max"] == 3.0
