"""Policy losses beyond PPO's token-level clip: GSPO and CISPO, registered by name.

Both follow ``ppo_clip``'s call convention (see ``losses.py``), so the trainer picks one by
``algorithm.policy_loss`` without branching on it, and both return the same metric keys.
Metrics are detached 0-dim tensors; nothing here syncs with the host.
"""

from __future__ import annotations

import torch
from torch import Tensor

from honing.algorithms.core import masked_mean
from honing.algorithms.losses import (
    Count,
    aggregate_loss,
    clipped_surrogate,
    policy_metrics,
    register_policy_loss,
)


@register_policy_loss("gspo")
def gspo(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 3e-4,
    clip_ratio_high: float = 4e-4,
    loss_agg: str = "seq_mean_token_mean",
    num_tokens: Count = None,
    num_seqs: Count = None,
    loss_scale_len: Count = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO: PPO's clipped objective on a length-normalised sequence-level ratio.

    ``s_i = exp(mean_t(logprobs - old_logprobs))`` over the sequence's response tokens,
    the geometric mean of its token ratios. Token-level ratios are noisy (for mixture-of-
    experts models, routing changes between the sampling and the training policy); one ratio
    per sequence is not. GSPO: https://arxiv.org/abs/2507.18071 . Computed in the paper's
    GSPO-token form, ``s_i,t = sg[s_i] * exp(logprobs_t - sg[logprobs_t])``: its value is
    ``s_i`` at every token, its gradient ``s_i * grad logprobs_t``, so with one advantage per
    sequence and ``seq_mean_token_mean`` it equals the sequence-level GSPO gradient, and
    per-token advantages remain possible. Per token, ``L = max(-A * s, -A * clip(s))``.

    A sequence ratio sits much closer to 1 than token ratios do, so the clip range is far
    narrower than PPO's: the paper uses ``3e-4`` / ``4e-4`` (the defaults here); the usual
    PPO values (0.2) would make the clip almost never act.

    Args:
        logprobs: ``[B, T]`` log-probabilities under the policy being trained (with grad).
        old_logprobs: ``[B, T]`` the same under the policy that sampled (no grad).
        advantages: ``[B, T]`` per-token advantages (no grad); usually constant per row.
        response_mask: ``[B, T]`` 1 on response tokens, 0 on padding.
        clip_ratio_low: The sequence ratio is clipped below at ``1 - clip_ratio_low``.
        clip_ratio_high: The sequence ratio is clipped above at ``1 + clip_ratio_high``.
        loss_agg: Aggregation mode, see ``aggregate_loss``; the paper's objective is
            ``seq_mean_token_mean`` (the default).
        num_tokens: Mini-batch token count, see ``aggregate_loss``.
        num_seqs: Mini-batch sequence count, see ``aggregate_loss``.
        loss_scale_len: Constant length for ``seq_mean_token_sum_norm``.

    Returns:
        ``(loss, metrics)`` with ``actor/pg_loss``, ``actor/pg_clipfrac`` (tokens whose
        sequence ratio was clipped against them), ``actor/pg_clipfrac_lower`` (those with
        ``s < 1 - low`` and ``A < 0``) and ``actor/ppo_kl`` (token-level masked mean of
        ``old_logprobs - logprobs``), means over this call's tokens.
    """
    # log s_i: the mean token log-ratio over the response, clamped so exp cannot overflow.
    token_log_ratio = (logprobs - old_logprobs).detach()  # [B, T]
    seq_log_ratio = masked_mean(token_log_ratio, response_mask, dim=-1).clamp(-20.0, 20.0)  # [B]
    # GSPO-token: value s_i, gradient s_i * grad logprobs_t.
    ratio = torch.exp(seq_log_ratio.unsqueeze(-1) + logprobs - logprobs.detach())  # [B, T]
    pg_losses, clipped = clipped_surrogate(ratio, advantages, clip_ratio_low, clip_ratio_high)
    loss = aggregate_loss(
        pg_losses,
        response_mask,
        loss_agg,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        loss_scale_len=loss_scale_len,
    )

    clipped_lower = (ratio.detach() < 1 - clip_ratio_low) & (advantages < 0)  # [B, T]
    return loss, policy_metrics(loss, clipped, clipped_lower, logprobs, old_logprobs, response_mask)


@register_policy_loss("cispo")
def cispo(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 1.0,
    clip_ratio_high: float = 0.28,
    loss_agg: str = "token_mean",
    num_tokens: Count = None,
    num_seqs: Count = None,
    loss_scale_len: Count = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO: REINFORCE with a clipped, stop-gradient importance weight.

    ``L = -sg[clip(r, 1 - low, 1 + high)] * A * logprobs`` per token, with
    ``r = exp(logprobs - old_logprobs)``. MiniMax-M1:
    https://arxiv.org/abs/2506.13585 . PPO's clip zeroes the gradient of tokens whose ratio
    left the range, often rare "fork" tokens; here the weight is clipped instead, and every
    token keeps a gradient ``-w * A * grad logprobs``. On-policy (``r = 1``) the gradient
    equals PPO's, though the loss value (``-A * logprobs``) is on another scale.

    The paper sets no lower bound (``clip_ratio_low`` large) and tunes only
    ``clip_ratio_high``; the defaults here, 1.0 (weight >= 0, so never clipped below) and
    0.28, follow that and DAPO's clip-higher value.

    Args:
        logprobs: ``[B, T]`` log-probabilities under the policy being trained (with grad).
        old_logprobs: ``[B, T]`` the same under the policy that sampled (no grad).
        advantages: ``[B, T]`` per-token advantages (no grad).
        response_mask: ``[B, T]`` 1 on response tokens, 0 on padding.
        clip_ratio_low: The weight is clipped below at ``1 - clip_ratio_low``.
        clip_ratio_high: The weight is clipped above at ``1 + clip_ratio_high``.
        loss_agg: Aggregation mode, see ``aggregate_loss``; the paper normalises by the
            number of tokens (``token_mean``, the default).
        num_tokens: Mini-batch token count, see ``aggregate_loss``.
        num_seqs: Mini-batch sequence count, see ``aggregate_loss``.
        loss_scale_len: Constant length for ``seq_mean_token_sum_norm``.

    Returns:
        ``(loss, metrics)`` with ``actor/pg_loss``, ``actor/pg_clipfrac`` (tokens whose
        weight was clipped, on either side), ``actor/pg_clipfrac_lower`` (those clipped
        below) and ``actor/ppo_kl`` (masked mean of ``old_logprobs - logprobs``), means over
        this call's tokens.
    """
    # The log-ratio is clamped so that exp cannot overflow to inf on a stale sample.
    log_ratio = (logprobs - old_logprobs).detach().clamp(-20.0, 20.0)  # [B, T]
    ratio = torch.exp(log_ratio)  # [B, T]
    weight = ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)  # [B, T], no grad
    pg_losses = -advantages * weight * logprobs  # [B, T]
    loss = aggregate_loss(
        pg_losses,
        response_mask,
        loss_agg,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        loss_scale_len=loss_scale_len,
    )

    clipped_lower = ratio < 1 - clip_ratio_low  # [B, T] (ratio carries no gradient here)
    clipped = clipped_lower | (ratio > 1 + clip_ratio_high)  # [B, T]
    return loss, policy_metrics(loss, clipped, clipped_lower, logprobs, old_logprobs, response_mask)
