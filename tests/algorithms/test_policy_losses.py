"""PPO's clip, GSPO, CISPO and the contract every registered policy loss keeps, against
hand-computed values."""

import math

import pytest
import torch

from honing.algorithms import POLICY_LOSSES, get_policy_loss, register_policy_loss
from honing.algorithms.core import masked_mean
from honing.algorithms.losses import LOSS_AGGREGATIONS
from honing.algorithms.policy_losses import cispo, gspo, ppo_clip

# --- PPO clip --------------------------------------------------------------------------------

# Four tokens with old_logprobs = 0, so ratio = exp(logprobs); clip range [0.8, 1.2]:
#   A = +1, r = 1.5: max(-1.5, -1.2) = -1.2  clipped
#   A = +1, r = 0.5: max(-0.5, -0.8) = -0.5
#   A = -1, r = 1.5: max( 1.5,  1.2) =  1.5
#   A = -1, r = 0.5: max( 0.5,  0.8) =  0.8  clipped, lower side
# A fifth, masked token has a huge ratio and must not count.
RATIOS = torch.tensor([[1.5, 0.5, 1.5, 0.5, 50.0]])
ADVANTAGES = torch.tensor([[1.0, 1.0, -1.0, -1.0, -1.0]])
RESPONSE_MASK = torch.tensor([[1, 1, 1, 1, 0]])
OLD_LOGPROBS = torch.zeros(1, 5)


def _ppo(**options):
    logprobs = torch.log(RATIOS).requires_grad_()
    loss, metrics = ppo_clip(logprobs, OLD_LOGPROBS, ADVANTAGES, RESPONSE_MASK, **options)
    loss.backward()
    return loss, metrics, logprobs.grad


def test_ppo_clip_loss_and_metrics_by_hand():
    loss, metrics, _ = _ppo()
    # (-1.2 - 0.5 + 1.5 + 0.8) / 4 = 0.15
    assert loss.detach() == pytest.approx(0.15)
    assert metrics["actor/pg_loss"] == pytest.approx(0.15)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(0.5)  # tokens 1 and 4
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(0.25)  # token 4
    # mean(old - new) = (-ln 1.5 - ln 0.5 - ln 1.5 - ln 0.5) / 4 = (-0.405465 + 0.693147) / 2
    assert metrics["actor/ppo_kl"] == pytest.approx(0.143841, abs=1e-6)


def test_ppo_clip_gradient_is_zero_on_clipped_tokens():
    # d(-A r)/d logprob = -A r, over 4 tokens: token 2 gives -0.5 / 4 = -0.125,
    # token 3 gives 1.5 / 4 = 0.375; clipped tokens 1, 4 and the masked token 5 give 0.
    _, _, grad = _ppo()
    torch.testing.assert_close(grad, torch.tensor([[0.0, -0.125, 0.375, 0.0, 0.0]]))


def test_ppo_clip_asymmetric_range():
    # clip_ratio_high = 0.6 -> upper bound 1.6 > 1.5, so token 1 is no longer clipped:
    # (-1.5 - 0.5 + 1.5 + 0.8) / 4 = 0.075, clipfrac 1 / 4.
    loss, metrics, _ = _ppo(clip_ratio_high=0.6)
    assert loss.detach() == pytest.approx(0.075)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(0.25)


def test_ppo_clip_passes_aggregation_and_counts_through():
    # token_mean over 8 tokens of the mini-batch: 0.6 / 8 = 0.075.
    loss, _, _ = _ppo(num_tokens=8)
    assert loss.detach() == pytest.approx(0.075)
    # seq_mean_token_sum over one sequence: 0.6 / 1.
    loss, _, _ = _ppo(loss_agg="seq_mean_token_sum")
    assert loss.detach() == pytest.approx(0.6)


# Dual-clip with clip_ratio_c = 3 (old_logprobs = 0, clip range [0.8, 1.2], six valid tokens):
#   A = -1, r = 5:   max(5, 1.2) = 5,  min(5, 3) = 3      dual clip active
#   A = -1, r = 4:   max(4, 1.2) = 4,  min(4, 3) = 3      dual clip active
#   A = -1, r = 2:   max(2, 1.2) = 2,  min(2, 3) = 2
#   A = -1, r = 0.5: max(0.5, 0.8) = 0.8                   clipped (lower side), not dual
#   A = +1, r = 5:   max(-5, -1.2) = -1.2                  clipped; A > 0 has no dual clip
#   A = +1, r = 0.5: max(-0.5, -0.8) = -0.5
# A seventh, masked token (A = -1, r = 50) must not count.
DUAL_RATIOS = torch.tensor([[5.0, 4.0, 2.0, 0.5, 5.0, 0.5, 50.0]])
DUAL_ADVANTAGES = torch.tensor([[-1.0, -1.0, -1.0, -1.0, 1.0, 1.0, -1.0]])
DUAL_MASK = torch.tensor([[1, 1, 1, 1, 1, 1, 0]])


def _dual(**options):
    logprobs = torch.log(DUAL_RATIOS).requires_grad_()
    loss, metrics = ppo_clip(logprobs, torch.zeros(1, 7), DUAL_ADVANTAGES, DUAL_MASK, **options)
    loss.backward()
    return loss, metrics, logprobs.grad


def test_dual_clip_loss_metrics_and_gradient_by_hand():
    loss, metrics, grad = _dual(clip_ratio_c=3.0)
    # (3 + 3 + 2 + 0.8 - 1.2 - 0.5) / 6 = 7.1 / 6 = 1.183333
    assert loss.detach() == pytest.approx(7.1 / 6)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(2 / 6)  # r = 0.5 (A < 0), r = 5 (A > 0)
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(2 / 6)  # dual clip: r = 5, 4
    # The dual-clipped loss -A * c is constant: no gradient there. Unclipped tokens give
    # -A * r / 6: r = 2 -> 2 / 6 = 0.333333; A = +1, r = 0.5 -> -0.5 / 6 = -0.083333.
    expected = torch.tensor([[0.0, 0.0, 2 / 6, 0.0, 0.0, -0.5 / 6, 0.0]])
    torch.testing.assert_close(grad, expected)


def test_without_dual_clip_large_ratios_keep_their_loss_and_gradient():
    # Control: (5 + 4 + 2 + 0.8 - 1.2 - 0.5) / 6 = 10.1 / 6; clipfrac_lower keeps its meaning,
    # r < 0.8 with A < 0: one token. Gradients 5 / 6 and 4 / 6 on the first two tokens.
    loss, metrics, grad = _dual()
    assert loss.detach() == pytest.approx(10.1 / 6)
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(1 / 6)
    expected = torch.tensor([[5 / 6, 4 / 6, 2 / 6, 0.0, 0.0, -0.5 / 6, 0.0]])
    torch.testing.assert_close(grad, expected)


def test_dual_clip_bound_above_the_ratios_changes_nothing():
    # c = 10 exceeds every valid ratio, so min(L, 10) = L: same loss as without dual-clip,
    # and no token counts as dual-clipped.
    loss, metrics, _ = _dual(clip_ratio_c=10.0)
    assert loss.detach() == pytest.approx(10.1 / 6)
    assert metrics["actor/pg_clipfrac_lower"] == 0.0


def test_dual_clip_rejects_a_bound_not_above_one():
    with pytest.raises(ValueError, match="clip_ratio_c must be greater than 1"):
        _dual(clip_ratio_c=1.0)


def test_ppo_clip_passes_loss_scale_len_through():
    # seq_mean_token_sum_norm: 0.6 summed / (1 seq * 4) = 0.15; with loss_scale_len 10: 0.06.
    loss, _, _ = _ppo(loss_agg="seq_mean_token_sum_norm", loss_scale_len=4)
    assert loss.detach() == pytest.approx(0.15)
    loss, _, _ = _ppo(loss_agg="seq_mean_token_sum_norm", loss_scale_len=10)
    assert loss.detach() == pytest.approx(0.06)


def test_ppo_clip_clamps_log_ratio_before_exp():
    # exp(100) overflows float32 to inf; clamped at 20, the loss is exp(20) = 4.85e8.
    loss, _ = ppo_clip(
        torch.tensor([[100.0]]), torch.zeros(1, 1), torch.tensor([[-1.0]]), torch.ones(1, 1)
    )
    assert torch.isfinite(loss)
    assert loss == pytest.approx(math.exp(20.0), rel=1e-5)


def test_ppo_clip_rejects_unknown_options():
    with pytest.raises(TypeError):
        ppo_clip(
            torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), clip_c=3.0
        )


def test_policy_loss_registry():
    assert get_policy_loss("ppo_clip") is ppo_clip
    with pytest.raises(
        ValueError, match="unknown policy loss 'reinforce'; choose one of: cispo, gspo, ppo_clip"
    ):
        get_policy_loss("reinforce")
    with pytest.raises(ValueError, match="already registered"):
        register_policy_loss("ppo_clip")(ppo_clip)
    assert POLICY_LOSSES["ppo_clip"] is ppo_clip


# --- GSPO ------------------------------------------------------------------------------------

# Two sequences, old_logprobs = 0. Row 0 (two tokens, then padding holding 5.0):
# s_0 = exp((0.2 - 0.1) / 2) = exp(0.05) = 1.051271. Row 1 (a single-token response, then
# padding): s_1 = exp(-0.3) = 0.740818. Advantages +1 and -1.
GSPO_LOGPROBS = torch.tensor([[0.2, -0.1, 5.0], [-0.3, 9.0, 9.0]])
GSPO_ADVANTAGES = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
GSPO_MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])


def _gspo(**options):
    logprobs = GSPO_LOGPROBS.clone().requires_grad_()
    loss, metrics = gspo(logprobs, torch.zeros(2, 3), GSPO_ADVANTAGES, GSPO_MASK, **options)
    loss.backward()
    return loss, metrics, logprobs.grad


def test_gspo_by_hand_with_a_ppo_sized_clip_range():
    # Range [0.8, 1.2]. Row 0: s = 1.051271 inside, -A * s = -1.051271 on both tokens (PPO
    # would clip its first token, whose own ratio exp(0.2) = 1.221403 is above 1.2).
    # Row 1: s = 0.740818 < 0.8 with A < 0: max(0.740818, 0.8) = 0.8, clipped.
    # seq_mean_token_mean: (-1.051271 + 0.8) / 2 = -0.125636.
    loss, metrics, grad = _gspo(clip_ratio_low=0.2, clip_ratio_high=0.2)
    assert loss.detach() == pytest.approx(-0.125636, abs=1e-6)
    # Each row-0 token's gradient: 1/2 (seqs) * 1/2 (tokens) * -A * s = -0.262818.
    expected = torch.tensor([[-0.262818, -0.262818, 0.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(grad, expected, atol=1e-6, rtol=0)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(1 / 3)  # row 1's one token of three
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(1 / 3)
    # Token-level mean of old - new: -(0.2 - 0.1 - 0.3) / 3 = 0.066667.
    assert metrics["actor/ppo_kl"] == pytest.approx(0.2 / 3)


def test_gspo_default_clip_range_is_the_papers():
    # [1 - 3e-4, 1 + 4e-4]: row 0 clipped to 1.0004 (A > 0), row 1 to 0.9997 (A < 0).
    # (-1.0004 + 0.9997) / 2 = -0.00035; every token clipped, so no gradient anywhere.
    loss, metrics, grad = _gspo()
    assert loss.detach() == pytest.approx(-0.00035, abs=1e-7)
    torch.testing.assert_close(grad, torch.zeros(2, 3))
    assert metrics["actor/pg_clipfrac"] == pytest.approx(1.0)


def _gspo_sequence_level(logprobs, old_logprobs, seq_advantages, mask, clip_low, clip_high):
    """The paper's sequence-level objective, written directly: one ratio per sequence."""
    seq_ratio = torch.exp(masked_mean(logprobs - old_logprobs, mask, dim=-1))  # [B]
    clipped = seq_ratio.clamp(1 - clip_low, 1 + clip_high)  # [B]
    return torch.maximum(-seq_advantages * seq_ratio, -seq_advantages * clipped).mean()


def test_gspo_token_form_matches_the_sequence_level_gradient():
    torch.manual_seed(0)
    lengths = torch.tensor([4, 1, 3, 2, 4, 2])
    mask = (torch.arange(4)[None, :] < lengths[:, None]).long()  # [6, 4]
    old_logprobs = -torch.rand(6, 4)
    logprobs = (old_logprobs + 0.1 * torch.randn(6, 4)).requires_grad_()
    seq_advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, -2.0, 1.5])
    expected_loss = _gspo_sequence_level(logprobs, old_logprobs, seq_advantages, mask, 0.03, 0.03)
    (expected_grad,) = torch.autograd.grad(expected_loss, logprobs)
    loss, metrics = gspo(
        logprobs,
        old_logprobs,
        seq_advantages[:, None].expand(6, 4),
        mask,
        clip_ratio_low=0.03,
        clip_ratio_high=0.03,
    )
    (grad,) = torch.autograd.grad(loss, logprobs)
    # The example has clipped and unclipped sequences, so both branches are compared.
    assert 0 < metrics["actor/pg_clipfrac"] < 1
    torch.testing.assert_close(loss, expected_loss)
    torch.testing.assert_close(grad, expected_grad)


# --- CISPO -----------------------------------------------------------------------------------

# old_logprobs = 0, so r = exp(logprobs); weight range [0.8, 1.28]:
#   A = +1, r = 1.5: w = 1.28 (clipped), loss -1.28 * ln 1.5 = -0.518995
#   A = -1, r = 0.5: w = 0.8 (clipped below), loss 0.8 * ln 0.5 = -0.554518
#   A = +1, r = 1.1: w = 1.1, loss -1.1 * ln 1.1 = -0.104841
# A fourth, masked token has a huge ratio and must not count.
CISPO_RATIOS = torch.tensor([[1.5, 0.5, 1.1, 50.0]])
CISPO_ADVANTAGES = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
CISPO_MASK = torch.tensor([[1, 1, 1, 0]])


def _cispo(**options):
    logprobs = torch.log(CISPO_RATIOS).requires_grad_()
    old_logprobs = torch.zeros(1, 4, requires_grad=True)
    loss, metrics = cispo(logprobs, old_logprobs, CISPO_ADVANTAGES, CISPO_MASK, **options)
    loss.backward()
    return loss, metrics, logprobs.grad, old_logprobs.grad


def test_cispo_loss_and_metrics_by_hand():
    loss, metrics, _, _ = _cispo(clip_ratio_low=0.2, clip_ratio_high=0.28)
    # (-0.518995 - 0.554518 - 0.104841) / 3 = -0.392785
    assert loss.detach() == pytest.approx(-0.392785, abs=1e-6)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(2 / 3)  # r = 1.5 and r = 0.5
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(1 / 3)  # r = 0.5
    # -(ln 1.5 + ln 0.5 + ln 1.1) / 3 = -(0.405465 - 0.693147 + 0.095310) / 3 = 0.064124
    assert metrics["actor/ppo_kl"] == pytest.approx(0.064124, abs=1e-6)


def test_cispo_gradient_flows_only_through_logprobs():
    # d/d logprob of -sg[w] * A * logprob is -w * A (/ 3 tokens), clipped tokens included:
    # -1.28 / 3 = -0.426667, 0.8 / 3 = 0.266667, -1.1 / 3 = -0.366667. Were w not detached,
    # the unclipped third token would get -(1.1 + 1.1 * ln 1.1) / 3 instead.
    _, _, grad, old_grad = _cispo(clip_ratio_low=0.2, clip_ratio_high=0.28)
    torch.testing.assert_close(grad, torch.tensor([[-1.28 / 3, 0.8 / 3, -1.1 / 3, 0.0]]))
    assert old_grad is None  # the importance weight carries no gradient to old_logprobs


def test_cispo_defaults_set_no_lower_bound():
    # clip_ratio_low = 1 puts the lower bound at 0: r = 0.5 keeps w = 0.5, loss 0.5 * ln 0.5
    # = -0.346574; (-0.518995 - 0.346574 - 0.104841) / 3 = -0.323470. Only r = 1.5 clipped.
    loss, metrics, _, _ = _cispo()
    assert loss.detach() == pytest.approx(-0.323470, abs=1e-6)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(1 / 3)
    assert metrics["actor/pg_clipfrac_lower"] == 0.0


def test_cispo_on_policy_gradient_equals_ppo():
    # With r = 1 both gradients are -A * grad logprob per token.
    torch.manual_seed(0)
    old_logprobs = -torch.rand(3, 4)
    advantages = torch.randn(3, 4)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    grads = []
    for name in ("cispo", "ppo_clip"):
        logprobs = old_logprobs.clone().requires_grad_()
        loss, _ = get_policy_loss(name)(logprobs, old_logprobs, advantages, mask)
        grads.append(torch.autograd.grad(loss, logprobs)[0])
    torch.testing.assert_close(grads[0], grads[1])
    assert grads[0].abs().sum() > 0


# --- every policy loss -----------------------------------------------------------------------

LENGTHS = torch.tensor([5, 1, 3, 4, 2, 1])


def _batch():
    torch.manual_seed(0)
    mask = (torch.arange(5)[None, :] < LENGTHS[:, None]).long()  # [6, 5]
    old_logprobs = -torch.rand(6, 5)
    logprobs = (old_logprobs + 0.2 * torch.randn(6, 5)).requires_grad_()
    advantages = torch.randn(6)[:, None].expand(6, 5)  # one advantage per sequence
    return logprobs, old_logprobs, advantages, mask


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_every_policy_loss_returns_the_same_detached_metrics(name):
    logprobs, old_logprobs, advantages, mask = _batch()
    loss, metrics = get_policy_loss(name)(
        logprobs, old_logprobs, advantages, mask, clip_ratio_low=0.2, clip_ratio_high=0.2
    )
    assert loss.dim() == 0 and loss.requires_grad and torch.isfinite(loss)
    assert set(metrics) == {
        "actor/pg_loss",
        "actor/pg_clipfrac",
        "actor/pg_clipfrac_lower",
        "actor/ppo_kl",
    }
    for value in metrics.values():
        assert value.dim() == 0 and not value.requires_grad and torch.isfinite(value)


@pytest.mark.parametrize("mode", sorted(LOSS_AGGREGATIONS))
@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_every_policy_loss_is_micro_batch_invariant(name, mode):
    # Micro-batches trimmed to their own width, given the mini-batch's counts, must add up
    # to the full batch's loss and gradient.
    logprobs, old_logprobs, advantages, mask = _batch()
    options = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "loss_agg": mode}
    loss_fn = get_policy_loss(name)
    full_loss, _ = loss_fn(logprobs, old_logprobs, advantages, mask, **options)
    (full_grad,) = torch.autograd.grad(full_loss, logprobs)

    counts = {"num_tokens": mask.sum(), "num_seqs": 6, "loss_scale_len": 5}
    total = torch.zeros(())
    for rows in torch.arange(6).split([1, 3, 2]):
        width = int(LENGTHS[rows].max())
        part, _ = loss_fn(
            logprobs[rows, :width],
            old_logprobs[rows, :width],
            advantages[rows, :width],
            mask[rows, :width],
            **options,
            **counts,
        )
        total = total + part
    (grad,) = torch.autograd.grad(total, logprobs)
    assert full_grad.abs().sum() > 0
    torch.testing.assert_close(total, full_loss)
    torch.testing.assert_close(grad, full_grad)


def test_policy_loss_registry_has_the_new_losses():
    assert get_policy_loss("gspo") is gspo
    assert get_policy_loss("cispo") is cispo
    assert POLICY_LOSSES["gspo"] is gspo and POLICY_LOSSES["cispo"] is cispo
