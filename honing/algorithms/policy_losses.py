"""Policy losses, registered by name: PPO's clipped surrogate, GSPO and CISPO.

Every policy loss is called the same way, so the trainer picks one by
``algorithm.policy_loss`` and never branches on it::

    loss, metrics = get_policy_loss(name)(
        logprobs, old_logprobs, advantages, response_mask,
        clip_ratio_low=..., clip_ratio_high=..., loss_agg=...,
        num_tokens=..., num_seqs=..., loss_scale_len=...,
    )

The inputs are ``[B, T]``: ``logprobs`` under the policy being trained (with grad),
``old_logprobs`` under the policy that sampled, per-token ``advantages`` (both without
grad) and ``response_mask``, 1 on response tokens and 0 on padding. A loss is written as its
per-token terms (``TokenLosses``: the loss, and where a clip acted); ``register_policy_loss``
adds what every loss shares: the reduction to a scalar by ``aggregate_loss`` (mode
``loss_agg``; the mini-batch counts ``num_tokens`` / ``num_seqs`` / ``loss_scale_len``, see
``losses.py``) and the metrics ``actor/pg_loss``, ``actor/pg_clipfrac``,
``actor/pg_clipfrac_lower`` and ``actor/ppo_kl`` (masked mean of ``old_logprobs -
logprobs``): detached 0-dim tensors, the fractions and the KL means over this call's tokens
whatever the mode. Nothing here syncs with the host.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from honing.algorithms.core import masked_mean
from honing.algorithms.losses import Count, aggregate_loss
from honing.algorithms.registry import lookup, register

PolicyLoss = Callable[..., tuple[Tensor, dict[str, Tensor]]]

POLICY_LOSSES: dict[str, PolicyLoss] = {}


class TokenLosses(NamedTuple):
    """A policy loss before aggregation; each ``[B, T]``."""

    losses: Tensor  # the loss of each token (with grad)
    clipped: Tensor  # bool: tokens a clip acted on (actor/pg_clipfrac)
    clipped_lower: Tensor  # bool: the loss's lower-side clip (actor/pg_clipfrac_lower)


def register_policy_loss(
    name: str, *, loss_agg: str = "token_mean"
) -> Callable[[Callable[..., TokenLosses]], PolicyLoss]:
    """Decorator that turns a per-token loss into a policy loss and adds it to
    ``POLICY_LOSSES`` under ``name``.

    The decorated function takes ``(logprobs, old_logprobs, advantages, response_mask)`` and
    its own keyword settings and returns ``TokenLosses``. The policy loss it becomes takes
    the same, plus ``loss_agg`` (default: this decorator's, the loss's paper's choice),
    ``num_tokens``, ``num_seqs`` and ``loss_scale_len``, and returns ``(loss, metrics)``.

    Raises:
        ValueError: If ``name`` is already taken.
    """

    default_agg = loss_agg

    def decorator(token_loss: Callable[..., TokenLosses]) -> PolicyLoss:
        @functools.wraps(token_loss)
        def policy_loss(
            logprobs: Tensor,
            old_logprobs: Tensor,
            advantages: Tensor,
            response_mask: Tensor,
            *,
            loss_agg: str = default_agg,
            num_tokens: Count = None,
            num_seqs: Count = None,
            loss_scale_len: Count = None,
            **settings: float | None,
        ) -> tuple[Tensor, dict[str, Tensor]]:
            terms = token_loss(logprobs, old_logprobs, advantages, response_mask, **settings)
            loss = aggregate_loss(
                terms.losses,
                response_mask,
                loss_agg,
                num_tokens=num_tokens,
                num_seqs=num_seqs,
                loss_scale_len=loss_scale_len,
            )
            return loss, _metrics(loss, terms, logprobs, old_logprobs, response_mask)

        return register(POLICY_LOSSES, "policy loss", name)(policy_loss)

    return decorator


def _metrics(
    loss: Tensor, terms: TokenLosses, logprobs: Tensor, old_logprobs: Tensor, mask: Tensor
) -> dict[str, Tensor]:
    with torch.no_grad():
        return {
            "actor/pg_loss": loss.detach(),
            "actor/pg_clipfrac": masked_mean(terms.clipped.to(logprobs.dtype), mask),
            "actor/pg_clipfrac_lower": masked_mean(terms.clipped_lower.to(logprobs.dtype), mask),
            "actor/ppo_kl": masked_mean(old_logprobs - logprobs, mask),
        }


def get_policy_loss(name: str) -> PolicyLoss:
    """Returns the policy loss registered under ``name``.

    Raises:
        ValueError: If no policy loss has that name; the message lists the known ones.
    """
    return lookup(POLICY_LOSSES, "policy loss", name)


def clipped_surrogate(
    ratio: Tensor, advantages: Tensor, clip_ratio_low: float, clip_ratio_high: float
) -> tuple[Tensor, Tensor]:
    """PPO's pessimistic surrogate ``max(-A r, -A clip(r))`` per token, and where the clipped
    branch is the larger (bool). All [B, T]. https://arxiv.org/abs/1707.06347 eq. 7."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


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
) -> TokenLosses:
    """PPO's clipped surrogate objective, as a loss to minimise.

    ``L = max(-A * r, -A * clip(r, 1 - low, 1 + high))`` per token with
    ``r = exp(logprobs - old_logprobs)``; PPO, eq. 7: https://arxiv.org/abs/1707.06347 .
    Separate low / high ranges allow DAPO's clip-higher (https://arxiv.org/abs/2503.14476).
    With ``clip_ratio_c`` (dual-clip, https://arxiv.org/abs/1912.09729), tokens with
    ``A < 0`` take ``min(L, -A * clip_ratio_c)``: a very large ratio on a bad token can no
    longer make the loss (and its gradient) unbounded. Aggregated by ``token_mean`` unless
    ``loss_agg`` says otherwise (see ``register_policy_loss``).

    Args:
        clip_ratio_low: The ratio is clipped below at ``1 - clip_ratio_low``.
        clip_ratio_high: The ratio is clipped above at ``1 + clip_ratio_high``.
        clip_ratio_c: Dual-clip bound, greater than 1 (3.0 in the paper and verl); None
            turns dual-clip off.

    Returns:
        ``clipped``: tokens where the clipped term was the larger. ``clipped_lower``: without
        dual-clip, tokens with ``r < 1 - low`` and ``A < 0``; with it, tokens where the dual
        clip is active, ``A < 0`` and ``L > -A * clip_ratio_c``, as in verl.

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
    return TokenLosses(pg_losses, clipped, clipped_lower)


@register_policy_loss("gspo", loss_agg="seq_mean_token_mean")
def gspo(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 3e-4,
    clip_ratio_high: float = 4e-4,
) -> TokenLosses:
    """GSPO: PPO's clipped objective on a length-normalised sequence-level ratio.

    ``s_i = exp(mean_t(logprobs - old_logprobs))`` over the sequence's response tokens,
    the geometric mean of its token ratios. Token-level ratios are noisy (for mixture-of-
    experts models, routing changes between the sampling and the training policy); one ratio
    per sequence is not. GSPO: https://arxiv.org/abs/2507.18071 . Computed in the paper's
    GSPO-token form, ``s_i,t = sg[s_i] * exp(logprobs_t - sg[logprobs_t])``: its value is
    ``s_i`` at every token, its gradient ``s_i * grad logprobs_t``, so with one advantage per
    sequence and ``seq_mean_token_mean`` it equals the sequence-level GSPO gradient, and
    per-token advantages remain possible (usually they are constant per row). Per token,
    ``L = max(-A * s, -A * clip(s))``.
    The paper's aggregation, ``seq_mean_token_mean``, is the default ``loss_agg``.

    A sequence ratio sits much closer to 1 than token ratios do, so the clip range is far
    narrower than PPO's: the paper uses ``3e-4`` / ``4e-4`` (the defaults here); the usual
    PPO values (0.2) would make the clip almost never act.

    Args:
        clip_ratio_low: The sequence ratio is clipped below at ``1 - clip_ratio_low``.
        clip_ratio_high: The sequence ratio is clipped above at ``1 + clip_ratio_high``.

    Returns:
        ``clipped``: tokens whose sequence ratio was clipped against them.
        ``clipped_lower``: those with ``s < 1 - low`` and ``A < 0``. (``actor/ppo_kl`` stays
        the token-level mean.)
    """
    # log s_i: the mean token log-ratio over the response, clamped so exp cannot overflow.
    token_log_ratio = (logprobs - old_logprobs).detach()  # [B, T]
    seq_log_ratio = masked_mean(token_log_ratio, response_mask, dim=-1).clamp(-20.0, 20.0)  # [B]
    # GSPO-token: value s_i, gradient s_i * grad logprobs_t.
    ratio = torch.exp(seq_log_ratio.unsqueeze(-1) + logprobs - logprobs.detach())  # [B, T]
    pg_losses, clipped = clipped_surrogate(ratio, advantages, clip_ratio_low, clip_ratio_high)
    clipped_lower = (ratio.detach() < 1 - clip_ratio_low) & (advantages < 0)  # [B, T]
    return TokenLosses(pg_losses, clipped, clipped_lower)


@register_policy_loss("cispo")
def cispo(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 1.0,
    clip_ratio_high: float = 0.28,
) -> TokenLosses:
    """CISPO: REINFORCE with a clipped, stop-gradient importance weight.

    ``L = -sg[clip(r, 1 - low, 1 + high)] * A * logprobs`` per token, with
    ``r = exp(logprobs - old_logprobs)``. MiniMax-M1:
    https://arxiv.org/abs/2506.13585 . PPO's clip zeroes the gradient of tokens whose ratio
    left the range, often rare "fork" tokens; here the weight is clipped instead, and every
    token keeps a gradient ``-w * A * grad logprobs``. On-policy (``r = 1``) the gradient
    equals PPO's, though the loss value (``-A * logprobs``) is on another scale. The paper
    normalises by the number of tokens (``token_mean``, the default ``loss_agg``).

    The paper sets no lower bound (``clip_ratio_low`` large) and tunes only
    ``clip_ratio_high``; the defaults here, 1.0 (weight >= 0, so never clipped below) and
    0.28, follow that and DAPO's clip-higher value.

    Args:
        clip_ratio_low: The weight is clipped below at ``1 - clip_ratio_low``.
        clip_ratio_high: The weight is clipped above at ``1 + clip_ratio_high``.

    Returns:
        ``clipped``: tokens whose weight was clipped, on either side. ``clipped_lower``:
        those clipped below.
    """
    # The log-ratio is clamped so that exp cannot overflow to inf on a stale sample.
    log_ratio = (logprobs - old_logprobs).detach().clamp(-20.0, 20.0)  # [B, T]
    ratio = torch.exp(log_ratio)  # [B, T]
    weight = ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)  # [B, T], no grad
    pg_losses = -advantages * weight * logprobs  # [B, T]
    clipped_lower = ratio < 1 - clip_ratio_low  # [B, T] (ratio carries no gradient here)
    clipped = clipped_lower | (ratio > 1 + clip_ratio_high)  # [B, T]
    return TokenLosses(pg_losses, clipped, clipped_lower)
