"""The policy update: any micro-batch split gives the mini-batch's gradient; step counts.

The equivalence test is the one OpenRLHF keeps for the class of bug that silently changes
training: normalising each micro-batch by its own token count instead of the mini-batch's.
Gradients are compared through the parameters after one plain SGD step with lr = 1, so the
parameter change *is* the (negated) accumulated gradient.
"""

import copy
import dataclasses
import random

import pytest
import torch

from honing.models.loading import load_causal_lm, load_tokenizer
from honing.trainer.batch import collate, response_logprobs
from honing.trainer.engine import TrainedModule
from honing.trainer.policy_update import UpdateSettings, mini_batches, update_policy
from honing.types import Rollout

CPU = torch.device("cpu")
PAD, EOS = 0, 1
# Uneven response lengths, so that micro-batches of 5 or 1 hold different token counts.
RESPONSE_LENGTHS = [1, 6, 4, 2, 7, 5, 3, 1, 6, 4, 2, 7]


@pytest.fixture(scope="module")
def model(micro_model_dir):
    tokenizer = load_tokenizer(micro_model_dir)
    return load_causal_lm(micro_model_dir, tokenizer, dtype="float32", device=CPU)


def make_rollouts(seed: int = 0, lengths: list[int] = RESPONSE_LENGTHS) -> list[Rollout]:
    """Prompts of 2..7 random tokens, responses of ``lengths``, every third ending in EOS."""
    rng = random.Random(seed)
    rollouts = []
    for i, length in enumerate(lengths):
        prompt = [rng.randrange(3, 99) for _ in range(rng.randint(2, 7))]
        response = [rng.randrange(3, 99) for _ in range(length)]
        stop = i % 3 == 0
        if stop:
            response[-1] = EOS
        rollouts.append(
            Rollout(
                prompt_id=f"p{i // 4}",
                group_index=i // 4,
                prompt_ids=prompt,
                response_ids=response,
                behaviour_logprobs=[-1.0] * len(response),
                finish_reason="stop" if stop else "length",
                weight_version=0,
                text="",
            )
        )
    return rollouts


@pytest.fixture(scope="module")
def experience(model):
    return make_experience(model, RESPONSE_LENGTHS)


def make_experience(model, lengths: list[int]) -> tuple:
    """A batch of ``lengths`` responses with random advantages, perturbed old logprobs and a
    different reference."""
    batch = collate(make_rollouts(lengths=lengths), pad_id=PAD, device=CPU)
    assert batch.response_mask.sum(-1).int().tolist() == lengths  # EOS included
    generator = torch.Generator().manual_seed(0)
    shape = batch.response_mask.shape  # [B, R]
    advantages = torch.randn(shape, generator=generator)
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
        current, _ = response_logprobs(model, batch)
        # Old logprobs away from the current ones, so that some ratios fall outside the clip.
        old_logprobs = current + 0.3 * torch.randn(shape, generator=generator)
        ref_logprobs, _ = response_logprobs(reference, batch)
    return batch, advantages, old_logprobs, ref_logprobs


def settings_for(loss_agg: str, micro_batch_size: int) -> UpdateSettings:
    return UpdateSettings(
        loss_agg=loss_agg,
        kl_coef=0.1,
        entropy_coef=0.01,
        grad_clip=0.0,
        micro_batch_size=micro_batch_size,
    )


def sgd_step(model, experience, settings) -> tuple[dict, dict[str, float]]:
    """Parameters after one SGD(lr=1) update of a copy of ``model``, and the metrics."""
    batch, advantages, old_logprobs, ref_logprobs = experience
    policy = copy.deepcopy(model)
    optimizer = torch.optim.SGD(policy.parameters(), lr=1.0)
    metrics = update_policy(
        TrainedModule("policy", policy, optimizer),
        batch,
        advantages,
        settings,
        old_logprobs=old_logprobs,
        ref_logprobs=ref_logprobs,
    )
    return {k: v.detach().clone() for k, v in policy.named_parameters()}, metrics


def reference_sgd_step(model, experience, loss_agg: str) -> dict:
    """The same update written out on the whole batch at once, formula by formula."""
    batch, advantages, old_logprobs, ref_logprobs = experience
    policy = copy.deepcopy(model).train()
    logprobs, entropy = response_logprobs(policy, batch, with_entropy=True, entropy_grad=True)
    mask = batch.response_mask  # [B, R]
    ratio = torch.exp(logprobs - old_logprobs)
    pg = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(0.8, 1.2))
    log_ratio = ref_logprobs - logprobs
    kl = torch.exp(log_ratio) - log_ratio - 1  # k3

    def agg(values):
        if loss_agg == "token_mean":
            return (values * mask).sum() / mask.sum()
        per_sequence = (values * mask).sum(-1)
        if loss_agg == "seq_mean_token_mean":
            per_sequence = per_sequence / mask.sum(-1)
        return per_sequence.mean()

    loss = agg(pg) + 0.1 * agg(kl) - 0.01 * agg(entropy)
    loss.backward()
    with torch.no_grad():
        return {k: (v - v.grad).clone() for k, v in policy.named_parameters()}


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
def test_micro_batch_split_does_not_change_the_update(model, experience, loss_agg):
    original = {k: v.detach().clone() for k, v in model.named_parameters()}
    whole, whole_metrics = sgd_step(model, experience, settings_for(loss_agg, 12))
    fives, fives_metrics = sgd_step(model, experience, settings_for(loss_agg, 5))
    ones, ones_metrics = sgd_step(model, experience, settings_for(loss_agg, 1))
    expected = reference_sgd_step(model, experience, loss_agg)

    moved = max(float((whole[k] - original[k]).abs().max()) for k in original)
    assert moved > 1e-3  # the step did something, so equality below means something
    for name in original:
        torch.testing.assert_close(whole[name], expected[name], atol=1e-6, rtol=0)
        torch.testing.assert_close(fives[name], whole[name], atol=1e-6, rtol=0)
        torch.testing.assert_close(ones[name], whole[name], atol=1e-6, rtol=0)

    # The reported metrics are those of the whole mini-batch, whatever the split (but the
    # split's own: micro-batches per step).
    assert whole_metrics["actor/pg_clipfrac"] > 0  # the old logprobs do trigger clipping
    assert whole_metrics["actor/kl_loss"] > 0
    assert set(fives_metrics) == set(whole_metrics) == set(ones_metrics)
    split = [m["perf/micro_batches"] for m in (whole_metrics, fives_metrics, ones_metrics)]
    assert split == [1, 3, 12]
    for name, value in whole_metrics.items():
        if name in ("perf/micro_batches", "memory/activation_peak_mb"):  # the split's own
            continue
        assert fives_metrics[name] == pytest.approx(value, abs=1e-5), name
        assert ones_metrics[name] == pytest.approx(value, abs=1e-5), name


def test_on_policy_loss_is_minus_the_mean_advantage(model, experience):
    batch = experience[0]
    advantages = torch.full(batch.response_mask.shape, 0.5)
    policy = copy.deepcopy(model)
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.0)
    # old_logprobs=None: the ratio is exactly 1, so each token's loss is -A = -0.5.
    metrics = update_policy(
        TrainedModule("policy", policy, optimizer), batch, advantages, UpdateSettings()
    )
    assert metrics["actor/pg_loss"] == pytest.approx(-0.5, abs=1e-6)
    assert metrics["actor/pg_clipfrac"] == 0.0
    assert metrics["actor/ppo_kl"] == 0.0
    assert "actor/kl_loss" not in metrics


def test_grad_clip_bounds_the_step(model, experience):
    batch, advantages, old_logprobs, _ = experience
    policy = copy.deepcopy(model)
    optimizer = torch.optim.SGD(policy.parameters(), lr=1.0)
    settings = UpdateSettings(grad_clip=1e-3)
    metrics = update_policy(
        TrainedModule("policy", policy, optimizer),
        batch,
        advantages,
        settings,
        old_logprobs=old_logprobs,
    )
    assert metrics["actor/grad_norm"] > 1e-3  # the norm before clipping is reported
    # With lr = 1 the parameter change is the clipped gradient: its norm is the clip value.
    with torch.no_grad():
        change = torch.cat(
            [
                (p - q).flatten()
                for p, q in zip(policy.parameters(), model.parameters(), strict=True)
            ]
        )
    assert float(change.norm()) == pytest.approx(1e-3, rel=1e-3)


# --- PPO epochs and mini-batches --------------------------------------------------------------


def test_mini_batches_cover_each_epoch_once():
    settings = UpdateSettings(ppo_epochs=2, mini_batch_sequences=4)
    chunks = list(mini_batches(10, settings, torch.Generator().manual_seed(0)))
    assert [len(c) for c in chunks] == [4, 4, 2, 4, 4, 2]
    for epoch in (chunks[:3], chunks[3:]):
        assert sorted(torch.cat(epoch).tolist()) == list(range(10))
    assert torch.cat(chunks[:3]).tolist() != list(range(10))  # shuffled
    assert settings.optimizer_steps_per_batch(10) == 6


def test_whole_batch_is_one_mini_batch_in_order():
    chunks = list(mini_batches(5, UpdateSettings(), torch.Generator().manual_seed(0)))
    assert [c.tolist() for c in chunks] == [[0, 1, 2, 3, 4]]
    assert UpdateSettings().optimizer_steps_per_batch(5) == 1


def test_two_epochs_of_two_mini_batches_take_four_optimizer_steps(model, experience):
    batch, advantages, old_logprobs, _ = experience
    policy = copy.deepcopy(model)
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.1)
    steps = []
    real_step = optimizer.step

    def counting_step(*args, **kwargs):
        steps.append(sum(1 for p in policy.parameters() if p.grad is not None))
        return real_step(*args, **kwargs)

    optimizer.step = counting_step
    settings = UpdateSettings(ppo_epochs=2, mini_batch_sequences=6, micro_batch_size=4)
    assert settings.optimizer_steps_per_batch(len(batch)) == 4
    metrics = update_policy(
        TrainedModule("policy", policy, optimizer),
        batch,
        advantages,
        settings,
        old_logprobs=old_logprobs,
    )
    assert len(steps) == 4
    assert all(count > 0 for count in steps)  # every step had gradients to apply
    assert metrics["actor/grad_norm"] > 0


def test_each_mini_batch_is_its_own_optimizer_step(model, experience):
    batch, advantages, old_logprobs, ref_logprobs = experience
    settings = UpdateSettings(
        mini_batch_sequences=6, micro_batch_size=4, grad_clip=0.0, kl_coef=0.1
    )
    policy = copy.deepcopy(model)
    update_policy(
        TrainedModule("policy", policy, torch.optim.SGD(policy.parameters(), lr=1.0)),
        batch,
        advantages,
        settings,
        old_logprobs=old_logprobs,
        ref_logprobs=ref_logprobs,
        generator=torch.Generator().manual_seed(5),
    )
    # The same two steps taken one by one: one whole-batch update per mini-batch, in the order
    # the update draws them, each starting from fresh gradients.
    expected = copy.deepcopy(model)
    optimizer = torch.optim.SGD(expected.parameters(), lr=1.0)
    order = list(mini_batches(len(batch), settings, torch.Generator().manual_seed(5)))
    assert [len(index) for index in order] == [6, 6]
    for index in order:
        expected.zero_grad(set_to_none=True)
        part = batch.select(index)
        width = part.responses.shape[1]
        update_policy(
            TrainedModule("policy", expected, optimizer),
            part,
            advantages[index, :width],
            dataclasses.replace(settings, mini_batch_sequences=0),
            old_logprobs=old_logprobs[index, :width],
            ref_logprobs=ref_logprobs[index, :width],
        )
    for actual, wanted in zip(policy.parameters(), expected.parameters(), strict=True):
        torch.testing.assert_close(actual, wanted, atol=1e-6, rtol=0)


@pytest.mark.parametrize("micro_batch_size", [12, 5, 1])
@pytest.mark.parametrize("level", ["none", "token", "sequence"])
def test_the_updates_forward_weighs_the_rollouts_as_an_old_pass_does(
    model, micro_batch_size, level
):
    """One optimizer step with ``gap``: the TIS weights and the engine/trainer gap come from
    the update's own forward, micro-batch by micro-batch; the step and the metrics equal
    those of a separate pass's old logprobs for any split (rounding only)."""
    from honing.algorithms.mismatch import mismatch_metrics, truncated_importance_weights

    batch, advantages, _, ref_logprobs = make_experience(model, RESPONSE_LENGTHS)
    mask = batch.response_mask
    with torch.no_grad():
        old, _ = response_logprobs(model, batch)
    noise = 0.3 * torch.randn(mask.shape, generator=torch.Generator().manual_seed(1))
    batch = dataclasses.replace(batch, behaviour_logprobs=(old + noise) * mask)
    settings = dataclasses.replace(
        settings_for("token_mean", micro_batch_size), tis_level=level, tis_cap=1.5
    )
    weighed = advantages
    if level != "none":
        weighed = advantages * truncated_importance_weights(
            old, batch.behaviour_logprobs, mask, level=level, cap=1.5
        )
    want, want_metrics = sgd_step(model, (batch, weighed, old, ref_logprobs), settings)
    gap = dataclasses.replace(settings, gap=True)
    got, metrics = sgd_step(model, (batch, advantages, None, ref_logprobs), gap)
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, atol=1e-6, rtol=1e-5)
    for key, value in mismatch_metrics(old, batch.behaviour_logprobs, mask).items():
        assert metrics[key] == pytest.approx(float(value), rel=1e-5, abs=1e-7), key
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy"):
        assert metrics[key] == pytest.approx(want_metrics[key], rel=1e-5, abs=1e-7), key


@pytest.mark.parametrize(
    ("level", "upper", "lower", "micro_batch_size"),
    [("token", 1.5, None, 5), ("sequence", 2.0, 0.5, 1), ("token", 1.3, 0.8, 12)],
)
def test_the_updates_forward_gives_the_rollout_correction_of_an_old_pass(
    model, level, upper, lower, micro_batch_size
):
    """Rollout correction's weights (TIS or IcePop) in the update's own forward: the step
    and every ``rollout_corr/*`` metric equal the whole batch's, for any micro-batch split
    (the metrics' sums and counts add up over micro-batches as over ranks)."""
    from honing.algorithms.rollout_correction import (
        CorrectionSettings,
        correct,
        correction_metrics,
    )

    batch, advantages, _, ref_logprobs = make_experience(model, RESPONSE_LENGTHS)
    mask = batch.response_mask
    with torch.no_grad():
        old, _ = response_logprobs(model, batch)
    noise = 0.3 * torch.randn(mask.shape, generator=torch.Generator().manual_seed(1))
    batch = dataclasses.replace(batch, behaviour_logprobs=(old + noise) * mask)
    correction = CorrectionSettings(level=level, upper=upper, lower=lower)
    settings = dataclasses.replace(
        settings_for("token_mean", micro_batch_size), correction=correction
    )
    whole = correct(old, batch.behaviour_logprobs, mask, correction)
    bounded = (whole.weights == 0) if lower else (whole.weights == upper)
    assert (bounded & (mask > 0)).any()  # the bounds act on some tokens
    want, _ = sgd_step(model, (batch, advantages * whole.weights, old, ref_logprobs), settings)
    got, metrics = sgd_step(
        model, (batch, advantages, None, ref_logprobs), dataclasses.replace(settings, gap=True)
    )
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, atol=1e-6, rtol=1e-5)
    expected = correction_metrics(whole.tally, correction)
    assert "rollout_corr/rollout_is_eff_sample_size" in expected
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
