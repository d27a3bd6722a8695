"""The gap between the rollout engine's sampling distribution and the trainer's policy.

Even with the same weights, an inference engine (other kernels, precision, batching) samples
from a slightly different distribution than the trainer computes: the behaviour logprobs
``mu`` differ from the trainer's old-policy logprobs ``pi_old``. Truncated importance sampling
(TIS, https://fengyao.notion.site/off-policy-rl) reweights each token's policy-gradient term by
``min(pi_old / mu, C)``, at token or sequence level, so the update stays an on-policy estimate.
Because the weight is positive and carries no gradient, multiplying the advantages by it is
the same as multiplying the per-token loss (for the clipped PPO surrogate too: ``max(-A w r,
-A w clip(r)) = w max(-A r, -A clip(r))`` for ``w > 0``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from honing.algorithms.core import masked_mean, masked_sum

TIS_LEVELS = ("token", "sequence")


def truncated_importance_weights(
    old_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, *, level: str, cap: float
) -> Tensor:
    """TIS weights ``min(pi_old / mu, cap)``, detached. All tensors [B, T]; returns [B, T].

    ``level="token"`` weighs each token by its own ratio; ``"sequence"`` weighs every token
    of a response by the product of its tokens' ratios (the sequence likelihood ratio).
    Padding gets weight 0.
    """
    log_ratio = (old_logprobs - behaviour_logprobs).detach() * mask  # [B, T]
    if level == "token":
        weights = torch.exp(log_ratio.clamp(max=20.0))
    elif level == "sequence":
        seq = masked_sum(log_ratio, mask, dim=-1).clamp(max=20.0)  # [B]
        weights = torch.exp(seq)[:, None].expand_as(mask)
    else:
        raise ValueError(f"unknown TIS level {level!r}; choose one of: {', '.join(TIS_LEVELS)}")
    return weights.clamp(max=cap) * mask


# The metrics of ``mismatch_metrics`` that are maxima (the others are means over tokens).
GAP_PEAKS = frozenset({"rollout_mismatch/prob_diff_max", "rollout_mismatch/logprob_diff_max"})


def mismatch_metrics(old_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor) -> dict:
    """Size of the engine/trainer gap over response tokens (detached scalar tensors).

    ``prob_diff_*``: |pi_old - mu| per token; ``logprob_diff_max``: the largest
    |log pi_old - log mu| (nats; a weight the engine did not get shows here first); ``kl``:
    the k3 estimate of KL(mu || pi_old) from tokens sampled under mu
    (http://joschu.net/blog/kl-approx.html).
    """
    old, behaviour = old_logprobs.detach(), behaviour_logprobs.detach()
    diff = (old.exp() - behaviour.exp()).abs()  # [B, T]
    log_ratio = (old - behaviour).clamp(-20.0, 20.0)
    k3 = torch.exp(log_ratio) - log_ratio - 1.0
    masked_max = torch.where(mask > 0, diff, torch.zeros_like(diff)).max()
    logprob_gap = torch.where(mask > 0, (old - behaviour).abs(), torch.zeros_like(diff)).max()
    return {
        "rollout_mismatch/prob_diff_mean": masked_mean(diff, mask),
        "rollout_mismatch/prob_diff_max": masked_max,
        "rollout_mismatch/logprob_diff_max": logprob_gap,
        "rollout_mismatch/kl": masked_mean(k3, mask),
    }
