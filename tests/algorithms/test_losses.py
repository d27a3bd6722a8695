"""KL estimators, loss aggregation and the PPO clipped loss against hand-computed values."""

import math

import pytest
import torch

from honing.algorithms.losses import (
    POLICY_LOSSES,
    aggregate_loss,
    get_policy_loss,
    kl_penalty,
    ppo_clip,
    register_policy_loss,
)

# --- KL estimators ---------------------------------------------------------------------------

LOGPROBS = torch.tensor([[-1.0, -2.0]])
REF_LOGPROBS = torch.tensor([[-1.5, -1.0]])


def test_kl_k1():
    # logprob - ref: -1 - (-1.5) = 0.5, -2 - (-1) = -1.
    torch.testing.assert_close(
        kl_penalty(LOGPROBS, REF_LOGPROBS, "k1"), torch.tensor([[0.5, -1.0]])
    )


def test_kl_k2():
    # 0.5 * 0.5^2 = 0.125, 0.5 * (-1)^2 = 0.5.
    torch.testing.assert_close(
        kl_penalty(LOGPROBS, REF_LOGPROBS, "k2"), torch.tensor([[0.125, 0.5]])
    )


def test_kl_k3_is_the_default():
    # d = ref - logprob = -0.5, 1: exp(-0.5) + 0.5 - 1 = 0.106531, exp(1) - 1 - 1 = 0.718282.
    expected = torch.tensor([[0.106531, 0.718282]])
    torch.testing.assert_close(kl_penalty(LOGPROBS, REF_LOGPROBS), expected)


def test_kl_k3_is_clamped():
    # d = 15: exp(15) - 16 = 3.27e6 -> 10. d = -30 -> -20: exp(-20) + 20 - 1 = 19 -> 10.
    kl = kl_penalty(torch.tensor([0.0, 0.0]), torch.tensor([15.0, -30.0]), "k3")
    torch.testing.assert_close(kl, torch.tensor([10.0, 10.0]))


def test_unknown_kl_estimator_names_the_choices():
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'; choose one of: k1, k2, k3"):
        kl_penalty(LOGPROBS, REF_LOGPROBS, "k4")


# --- aggregation -----------------------------------------------------------------------------

LOSS_MAT = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])


@pytest.mark.parametrize(
    ("mode", "counts", "expected"),
    [
        ("token_mean", {}, 7.0 / 3.0),  # (1 + 2 + 4) / 3 tokens
        ("token_mean", {"num_tokens": 7}, 1.0),  # 7 / 7
        ("token_mean", {"num_tokens": torch.tensor(14.0)}, 0.5),  # 7 / 14
        ("seq_mean_token_sum", {}, 3.5),  # (3 + 4) / 2 seqs
        ("seq_mean_token_sum", {"num_seqs": 4}, 1.75),  # 7 / 4
        ("seq_mean_token_mean", {}, 2.75),  # (1.5 + 4) / 2 seqs
        ("seq_mean_token_mean", {"num_seqs": 4.0}, 1.375),  # 5.5 / 4
        ("seq_mean_token_sum_norm", {}, 7.0 / 6.0),  # 7 / (2 seqs * 3 columns)
        ("seq_mean_token_sum_norm", {"num_seqs": 4, "loss_scale_len": 7}, 0.25),  # 7 / 28
        ("seq_mean_token_sum_norm", {"loss_scale_len": torch.tensor(10.0)}, 0.35),  # 7 / 20
    ],
)
def test_aggregate_loss_by_hand(mode, counts, expected):
    assert aggregate_loss(LOSS_MAT, MASK, mode, **counts) == pytest.approx(expected)


@pytest.mark.parametrize(
    "mode", ["token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
)
def test_aggregate_loss_of_empty_mask_is_zero(mode):
    loss = aggregate_loss(LOSS_MAT, torch.zeros_like(MASK), mode)
    assert loss == 0.0


def test_unknown_aggregation_names_the_choices():
    with pytest.raises(ValueError, match="unknown loss aggregation 'sum'; choose one of: seq_"):
        aggregate_loss(LOSS_MAT, MASK, "sum")


# --- micro-batch equivalence -----------------------------------------------------------------

MODES = ["token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
LENGTHS = torch.tensor([5, 1, 3, 4, 2, 1])  # response lengths of a 6-sequence mini-batch
SPLITS = [[6], [2, 4], [1, 3, 2]]  # micro-batch sizes: one, two and three uneven pieces


def _mini_batch():
    torch.manual_seed(0)
    weights = torch.randn(6, 5, requires_grad=True)  # the "parameters", [B, T]
    targets = torch.randn(6, 5)
    mask = (torch.arange(5)[None, :] < LENGTHS[:, None]).long()  # [B, T]
    return weights, targets, mask


def _loss_mat(weights, targets):
    return (weights - targets) ** 2 * torch.sigmoid(weights)  # [B, T], non-linear per token


def _accumulate(mode, split, use_global_counts):
    """Backprops each micro-batch (trimmed to its own longest response) and sums."""
    weights, targets, mask = _mini_batch()
    global_counts = {"num_tokens": mask.sum(), "num_seqs": mask.shape[0], "loss_scale_len": 5}
    counts = global_counts if use_global_counts else {}
    total = torch.zeros(())
    for rows in torch.arange(6).split(split):
        width = int(LENGTHS[rows].max())
        loss = aggregate_loss(
            _loss_mat(weights[rows, :width], targets[rows, :width]),
            mask[rows, :width],
            mode,
            **counts,
        )
        loss.backward()
        total = total + loss.detach()
    return total, weights.grad


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("split", SPLITS, ids=str)
def test_micro_batches_with_global_counts_match_the_full_batch(mode, split):
    weights, targets, mask = _mini_batch()
    full_loss = aggregate_loss(_loss_mat(weights, targets), mask, mode)
    full_loss.backward()

    total, grad = _accumulate(mode, split, use_global_counts=True)
    assert torch.allclose(total, full_loss.detach(), atol=1e-6)
    assert torch.allclose(grad, weights.grad, atol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_micro_batches_with_local_counts_do_not_match(mode):
    # The control for the test above: each micro-batch normalising by its own counts
    # gives a different loss, which is the silent bug the global counts prevent.
    weights, targets, mask = _mini_batch()
    full_loss = aggregate_loss(_loss_mat(weights, targets), mask, mode)
    total, _ = _accumulate(mode, [1, 3, 2], use_global_counts=False)
    assert not torch.allclose(total, full_loss.detach(), atol=1e-3)


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


def test_ppo_clip_metrics_are_detached_scalars():
    _, metrics, _ = _ppo()
    assert set(metrics) == {
        "actor/pg_loss",
        "actor/pg_clipfrac",
        "actor/pg_clipfrac_lower",
        "actor/ppo_kl",
    }
    for value in metrics.values():
        assert value.dim() == 0 and not value.requires_grad


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
