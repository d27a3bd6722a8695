"""Policy losses, loss aggregation and KL estimators, each chosen by name from a registry.

Policy losses share one signature, so the trainer picks one by ``algorithm.policy_loss``::

    loss, metrics = get_policy_loss(name)(
        logprobs, old_logprobs, advantages, response_mask,
        loss_agg=..., num_tokens=..., num_seqs=..., **loss_options,
    )

All inputs are ``[B, T]``. Metrics are detached 0-dim tensors (no ``.item()``: the caller
decides when to sync with the host).

Micro-batching: the trainer splits a mini-batch into micro-batches and accumulates their
gradients. Passing the whole mini-batch's ``num_tokens`` / ``num_seqs`` (and, for
``seq_mean_token_sum_norm``, a constant ``loss_scale_len``) to every micro-batch makes the sum
of the micro-batch losses equal the mini-batch loss exactly, whatever the split.

``ppo_clip`` lives here; the other policy losses (``gspo``, ``cispo``) are in
``policy_losses.py`` and join ``POLICY_LOSSES`` when the package is imported.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch import Tensor

from honing.algorithms.core import masked_mean, masked_sum

_Fn = TypeVar("_Fn", bound=Callable)

PolicyLoss = Callable[..., tuple[Tensor, dict[str, Tensor]]]
KLEstimator = Callable[[Tensor, Tensor], Tensor]
Count = Tensor | float | None
LossAggregation = Callable[[Tensor, Tensor, Count, Count, Count], Tensor]

POLICY_LOSSES: dict[str, PolicyLoss] = {}
KL_ESTIMATORS: dict[str, KLEstimator] = {}
LOSS_AGGREGATIONS: dict[str, LossAggregation] = {}


def _register(table: dict[str, _Fn], kind: str, name: str) -> Callable[[_Fn], _Fn]:
    def decorator(fn: _Fn) -> _Fn:
        if name in table:
            raise ValueError(f"{kind} {name!r} is already registered")
        table[name] = fn
        return fn

    return decorator


def _lookup(table: dict[str, _Fn], kind: str, name: str) -> _Fn:
    try:
        return table[name]
    except KeyError:
        raise ValueError(
            f"unknown {kind} {name!r}; choose one of: {', '.join(sorted(table))}"
        ) from None


def register_policy_loss(name: str) -> Callable[[PolicyLoss], PolicyLoss]:
    """Decorator that adds a policy loss to ``POLICY_LOSSES`` under ``name``.

    Raises:
        ValueError: If ``name`` is already taken.
    """
    return _register(POLICY_LOSSES, "policy loss", name)


def get_policy_loss(name: str) -> PolicyLoss:
    """Returns the policy loss registered under ``name``.

    Raises:
        ValueError: If no policy loss has that name; the message lists the known ones.
    """
    return _lookup(POLICY_LOSSES, "policy loss", name)


# ---------------------------------------------------------------------------------------------
# KL estimators: per-token estimates of KL(policy || reference) from samples of the policy.
# John Schulman, "Approximating KL Divergence": http://joschu.net/blog/kl-approx.html
# ---------------------------------------------------------------------------------------------


@_register(KL_ESTIMATORS, "KL estimator", "k1")
def _kl_k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    # k1 = log p - log q: unbiased, high variance, can be negative per token.
    return logprobs - ref_logprobs


@_register(KL_ESTIMATORS, "KL estimator", "k2")
def _kl_k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    # k2 = (log p - log q)^2 / 2: biased, low variance, never negative.
    return 0.5 * (logprobs - ref_logprobs) ** 2


@_register(KL_ESTIMATORS, "KL estimator", "k3")
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
    return _lookup(KL_ESTIMATORS, "KL estimator", estimator)(logprobs, ref_logprobs)


# ---------------------------------------------------------------------------------------------
# Loss aggregation: from a [B, T] matrix of per-token losses to one scalar.
# The modes follow verl's loss_agg_mode; Dr. GRPO (https://arxiv.org/abs/2503.20783) discusses
# the length bias of each.
# ---------------------------------------------------------------------------------------------


def _as_count(count: Tensor | float, like: Tensor) -> Tensor:
    """A count as a tensor on ``like``'s device and dtype, with 0 replaced by 1 (0 / 1 = 0)."""
    count = torch.as_tensor(count, dtype=like.dtype, device=like.device)
    return torch.where(count > 0, count, torch.ones_like(count))


@_register(LOSS_AGGREGATIONS, "loss aggregation", "token_mean")
def _token_mean(
    loss_mat: Tensor, mask: Tensor, num_tokens: Count, num_seqs: Count, loss_scale_len: Count
) -> Tensor:
    # Every token weighs the same: sum of token losses / number of tokens in the mini-batch.
    num_tokens = mask.sum() if num_tokens is None else num_tokens
    return masked_sum(loss_mat, mask) / _as_count(num_tokens, loss_mat)


@_register(LOSS_AGGREGATIONS, "loss aggregation", "seq_mean_token_sum")
def _seq_mean_token_sum(
    loss_mat: Tensor, mask: Tensor, num_tokens: Count, num_seqs: Count, loss_scale_len: Count
) -> Tensor:
    # Every sequence weighs by its length: token losses summed per sequence, averaged over seqs.
    seq_losses = masked_sum(loss_mat, mask, dim=-1)  # [B]
    num_seqs = loss_mat.shape[0] if num_seqs is None else num_seqs
    return seq_losses.sum() / _as_count(num_seqs, loss_mat)


@_register(LOSS_AGGREGATIONS, "loss aggregation", "seq_mean_token_mean")
def _seq_mean_token_mean(
    loss_mat: Tensor, mask: Tensor, num_tokens: Count, num_seqs: Count, loss_scale_len: Count
) -> Tensor:
    # Every sequence weighs the same (original GRPO): mean per sequence, averaged over seqs.
    seq_losses = masked_mean(loss_mat, mask, dim=-1)  # [B]
    num_seqs = loss_mat.shape[0] if num_seqs is None else num_seqs
    return seq_losses.sum() / _as_count(num_seqs, loss_mat)


@_register(LOSS_AGGREGATIONS, "loss aggregation", "seq_mean_token_sum_norm")
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
    aggregate = _lookup(LOSS_AGGREGATIONS, "loss aggregation", mode)
    return aggregate(loss_mat, mask, num_tokens, num_seqs, loss_scale_len)


# ---------------------------------------------------------------------------------------------
# Policy losses.
# ---------------------------------------------------------------------------------------------


def clipped_surrogate(
    ratio: Tensor, advantages: Tensor, clip_ratio_low: float, clip_ratio_high: float
) -> tuple[Tensor, Tensor]:
    """PPO's pessimistic surrogate ``max(-A r, -A clip(r))`` per token, and where the clipped
    branch is the larger (bool). All [B, T]. https://arxiv.org/abs/1707.06347 eq. 7."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def policy_metrics(
    loss: Tensor,
    clipped: Tensor,
    clipped_lower: Tensor,
    logprobs: Tensor,
    old_logprobs: Tensor,
    mask: Tensor,
) -> dict[str, Tensor]:
    """The metric keys every policy loss returns (detached, means over this call's tokens)."""
    with torch.no_grad():
        return {
            "actor/pg_loss": loss.detach(),
            "actor/pg_clipfrac": masked_mean(clipped.to(logprobs.dtype), mask),
            "actor/pg_clipfrac_lower": masked_mean(clipped_lower.to(logprobs.dtype), mask),
            "actor/ppo_kl": masked_mean(old_logprobs - logprobs, mask),
        }


@register_policy_loss("ppo_clip")
def ppo_clip(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float | None = None,
    loss_agg: str = "token_mean",
    num_tokens: Count = None,
    num_seqs: Count = None,
    loss_scale_len: Count = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped surrogate objective, as a loss to minimise.

    ``L = max(-A * r, -A * clip(r, 1 - low, 1 + high))`` per token with
    ``r = exp(logprobs - old_logprobs)``; PPO, eq. 7: https://arxiv.org/abs/1707.06347 .
    Separate low / high ranges allow DAPO's clip-higher (https://arxiv.org/abs/2503.14476).
    With ``clip_ratio_c`` (dual-clip, https://arxiv.org/abs/1912.09729), tokens with
    ``A < 0`` take ``min(L, -A * clip_ratio_c)``: a very large ratio on a bad token can no
    longer make the loss (and its gradient) unbounded.

    Args:
        logprobs: ``[B, T]`` log-probabilities under the policy being trained (with grad).
        old_logprobs: ``[B, T]`` the same under the policy that sampled (no grad).
        advantages: ``[B, T]`` per-token advantages (no grad).
        response_mask: ``[B, T]`` 1 on response tokens, 0 on padding.
        clip_ratio_low: The ratio is clipped below at ``1 - clip_ratio_low``.
        clip_ratio_high: The ratio is clipped above at ``1 + clip_ratio_high``.
        clip_ratio_c: Dual-clip bound, greater than 1 (3.0 in the paper and verl); None
            turns dual-clip off.
        loss_agg: Aggregation mode, see ``aggregate_loss``.
        num_tokens: Mini-batch token count, see ``aggregate_loss``.
        num_seqs: Mini-batch sequence count, see ``aggregate_loss``.
        loss_scale_len: Constant length for ``seq_mean_token_sum_norm``, see
            ``aggregate_loss``.

    Returns:
        ``(loss, metrics)``: a 0-dim loss and detached 0-dim metrics ``actor/pg_loss``,
        ``actor/pg_clipfrac`` (tokens where the clipped term was the larger),
        ``actor/pg_clipfrac_lower`` (without dual-clip: tokens with ``r < 1 - low`` and
        ``A < 0``; with it: tokens where the dual clip is active, ``A < 0`` and
        ``L > -A * clip_ratio_c``, as in verl) and ``actor/ppo_kl`` (masked mean of
        ``old_logprobs - logprobs``). The fractions and KL are means over this call's
        tokens, whatever the aggregation mode.

    Raises:
        ValueError: If ``clip_ratio_c`` is not greater than 1.
    """
    if clip_ratio_c is not None and not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c must be greater than 1 (dual-clip); got {clip_ratio_c}")
    # The log-ratio is clamped so that exp cannot overflow to inf on a stale sample.
    log_ratio = (logprobs - old_logprobs).clamp(-20.0, 20.0)  # [B, T]
    ratio = torch.exp(log_ratio)  # [B, T]
    pg_losses, clipped = clipped_surrogate(ratio, advantages, clip_ratio_low, clip_ratio_high)
    if clip_ratio_c is None:
        clipped_lower = (ratio < 1 - clip_ratio_low) & (advantages < 0)  # [B, T]
    else:
        dual_clip_losses = -advantages * clip_ratio_c  # [B, T]
        clipped_lower = (pg_losses > dual_clip_losses) & (advantages < 0)  # [B, T]
        pg_losses = torch.where(clipped_lower, dual_clip_losses, pg_losses)
    loss = aggregate_loss(
        pg_losses,
        response_mask,
        loss_agg,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        loss_scale_len=loss_scale_len,
    )

    return loss, policy_metrics(loss, clipped, clipped_lower, logprobs, old_logprobs, response_mask)
