"""The critic's loss for PPO: a clipped squared error to the GAE returns.

``L = 0.5 * max((V - R)^2, (V_clip - R)^2)`` with ``V_clip = V_old + clip(V - V_old, -c, c)``:
the value prediction may not move further than ``c`` from the pre-update value and profit
from it (PPO's value clipping, https://arxiv.org/abs/1707.06347 as implemented in OpenAI's
baselines and verl).
"""

from __future__ import annotations

from torch import Tensor

from honing.algorithms.core import masked_mean, masked_var
from honing.algorithms.losses import aggregate_loss


def clipped_value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    *,
    clip: float = 0.2,
    loss_agg: str = "token_mean",
    num_tokens=None,
    num_seqs=None,
    loss_scale_len=None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Value loss and metrics; all inputs [B, T]. Counts as in ``aggregate_loss``."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)  # [B, T]
    unclipped_loss = (values - returns) ** 2
    clipped_loss = (clipped - returns) ** 2
    per_token = 0.5 * unclipped_loss.maximum(clipped_loss)
    loss = aggregate_loss(
        per_token,
        mask,
        loss_agg,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        loss_scale_len=loss_scale_len,
    )
    metrics = {
        "critic/vf_loss": loss.detach(),
        "critic/vf_clipfrac": masked_mean((clipped_loss > unclipped_loss).float(), mask),
    }
    return loss, metrics


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """``1 - Var(R - V) / Var(R)`` over masked tokens: 1 is perfect, 0 no better than a mean."""
    residual = masked_var(returns - values, mask)
    return 1.0 - residual / masked_var(returns, mask).clamp(min=1e-8)
