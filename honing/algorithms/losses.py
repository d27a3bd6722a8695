"""Loss aggregation and KL estimators, each chosen by name from a registry.

``aggregate_loss`` reduces a ``[B, T]`` matrix of per-token losses to the scalar that is
minimised (``algorithm.loss_agg``); the policy losses (``policy_losses.py``), the KL term and
the entropy bonus all go through it. ``kl_penalty`` estimates the per-token KL to the
reference (``algorithm.kl_estimator``). Nothing here syncs with the host (no ``.item()``).

Micro-batching: the trainer splits a mini-batch into micro-batches and accumulates their
gradients. Passing the whole mini-batch's ``num_tokens`` / ``num_seqs`` (and, for
``seq_mean_token_sum_norm``, a constant ``loss_scale_len``) to every micro-batch makes the sum
of the micro-batch losses equal the mini-batch loss exactly, whatever the split.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from honing.algorithms.core import masked_mean, masked_sum
from honing.algorithms.registry import lookup, register

KLEstimator = Callable[[Tensor, Tensor], Tensor]
Count = Tensor | float | None
LossAggregation = Callable[[Tensor, Tensor, Count, Count, Count], Tensor]

KL_ESTIMATORS: dict[str, KLEstimator] = {}
LOSS_AGGREGATIONS: dict[str, LossAggregation] = {}


# ---------------------------------------------------------------------------------------------
# KL estimators: per-token estimates of KL(policy || reference) from samples of the policy.
# John Schulman, "Approximating KL Divergence": http://joschu.net/blog/kl-approx.html
# ---------------------------------------------------------------------------------------------


@register(KL_ESTIMATORS, "KL estimator", "k1")
def _kl_k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    # k1 = log p - log q: unbiased, high variance, can be negative per token.
    return logprobs - ref_logprobs


@register(KL_ESTIMATORS, "KL estimator", "k2")
def _kl_k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    # k2 = (log p - log q)^2 / 2: biased, low variance, never negative.
    return 0.5 * (logprobs - ref_logprobs) ** 2


@register(KL_ESTIMATORS, "KL estimator", "k3")
def _kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    # k3 = (r - 1) - log r with r = q / p: unbiased, low variance, never negative.
    # The log-ratio is clamped before exp so it cannot overflow; the result to [-10, 10] (verl).
    log_ratio = (ref_logprobs - logprobs).clamp(-20.0, 20.0)  # [B, T]
    return (torch.exp(log_ratio) - log_ratio - 1).clamp(-10.0, 10.0)


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token KL estimate between the policy and the reference policy.

    Args:
        logprobs: ``[B, T]`` log-probabilities of the sampled tokens under the policy.
        ref_logprobs: ``[B, T]`` the same under the reference policy.
        estimator: ``"k1"``, ``"k2"`` or ``"k3"``; see http://joschu.net/blog/kl-approx.html

    Returns:
        ``[B, T]`` per-token KL estimates, not masked: aggregate with ``aggregate_loss``.

    Raises:
        ValueError: For an unknown estimator name.
    """
    return lookup(KL_ESTIMATORS, "KL estimator", estimator)(logprobs, ref_logprobs)


# ---------------------------------------------------------------------------------------------
# Loss aggregation: from a [B, T] matrix of per-token losses to one scalar.
# The modes follow verl's loss_agg_mode; Dr. GRPO (https://arxiv.org/abs/2503.20783) discusses
# the length bias of each.
# ---------------------------------------------------------------------------------------------


def _as_count(count: Tensor | float, like: Tensor) -> Tensor:
    """A count as a tensor on ``like``'s device and dtype, with 0 replaced by 1 (0 / 1 = 0)."""
    count = torch.as_tensor(count, dtype=like.dtype, device=like.device)
    return torch.where(count > 0, count, torch.ones_like(count))


@register(LOSS_AGGREGATIONS, "loss aggregation", "token_mean")
def _token_mean(
    loss_mat: Tensor, mask: Tensor, num_tokens: Count, num_seqs: Count, loss_scale_len: Count
) -> Tensor:
    # Every token weighs the same: sum of token losses / number of tokens in the mini-batch.
    num_tokens = mask.sum() if num_tokens is None else num_tokens
    return masked_sum(loss_mat, mask) / _as_count(num_tokens, loss_mat)


@register(LOSS_AGGREGATIONS, "loss aggregation", "seq_mean_token_sum")
def _seq_mean_token_sum(
    loss_mat: Tensor, mask: Tensor, num_tokens: Count, num_seqs: Count, loss_scale_len: Count
) -> Tensor:
    # Every sequence weighs by its length: token losses summed per sequence, averaged over seqs.
    seq_losses = masked_sum(loss_mat, mask, dim=-1)  # [B]
    num_seqs = loss_mat.shape[0] if num_seqs is None else num_seqs
    return seq_losses.sum() / _as_count(num_seqs, loss_mat)


@register(LOSS_AGGREGATIONS, "loss aggregation", "seq_mean_token_mean")
def _seq_mean_token_mean(
    loss_mat: Tensor, mask: Tensor, num_tokens: Count, num_seqs: Count, loss_scale_len: Count
) -> Tensor:
    # Every sequence weighs the same (original GRPO): mean per sequence, averaged over seqs.
    seq_losses = masked_mean(loss_mat, mask, dim=-1)  # [B]
    num_seqs = loss_mat.shape[0] if num_seqs is None else num_seqs
    return seq_losses.sum() / _as_count(num_seqs, loss_mat)


@register(LOSS_AGGREGATIONS, "loss aggregation", "seq_mean_token_sum_norm")
def _seq_mean_token_sum_norm(
    loss_mat: Tensor, mask: Tensor, num_tokens: Count, num_seqs: Count, loss_scale_len: Count
) -> Tensor:
    # Dr. GRPO (https://arxiv.org/abs/2503.20783): token losses summed and divided by a
    # constant, so no response's tokens are up- or down-weighted by its length.
    num_seqs = loss_mat.shape[0] if num_seqs is None else num_seqs
    loss_scale_len = mask.shape[-1] if loss_scale_len is None else loss_scale_len
    normaliser = _as_count(num_seqs, loss_mat) * _as_count(loss_scale_len, loss_mat)
    return masked_sum(loss_mat, mask) / normaliser


def aggregate_loss(
    loss_mat: Tensor,
    mask: Tensor,
    mode: str = "token_mean",
    *,
    num_tokens: Count = None,
    num_seqs: Count = None,
    loss_scale_len: Count = None,
) -> Tensor:
    """Reduces per-token losses to a scalar.

    Modes:
        ``token_mean``: ``sum(loss * mask) / num_tokens``.
        ``seq_mean_token_sum``: per-sequence token sums, summed, ``/ num_seqs``.
        ``seq_mean_token_mean``: per-sequence token means, summed, ``/ num_seqs``.
        ``seq_mean_token_sum_norm``: ``sum(loss * mask) / (num_seqs * loss_scale_len)``,
        Dr. GRPO's constant normaliser; keep ``loss_scale_len`` the same all run (e.g. the
        maximum response length), or the normaliser varies with the batch again.

    For a micro-batch pass the whole mini-batch's counts, so micro-batch losses (and their
    gradients) add up to the mini-batch's. A count of 0 gives a loss of 0, not ``nan``.

    Args:
        loss_mat: ``[B, T]`` per-token losses.
        mask: ``[B, T]`` 1 on tokens that count, 0 on padding.
        mode: One of the names in ``LOSS_AGGREGATIONS``.
        num_tokens: Token count to divide by (``token_mean``); default ``mask.sum()``.
        num_seqs: Sequence count to divide by (``seq_mean_*``); default ``B``.
        loss_scale_len: Length to divide by (``seq_mean_token_sum_norm``); default ``T``,
            which changes with padding: pass a constant when micro-batches are trimmed.

    Returns:
        A 0-dim tensor.

    Raises:
        ValueError: For an unknown mode.
    """
    aggregate = lookup(LOSS_AGGREGATIONS, "loss aggregation", mode)
    return aggregate(loss_mat, mask, num_tokens, num_seqs, loss_scale_len)
