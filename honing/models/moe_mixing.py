"""How a mixture-of-experts router turns its logits and chosen experts into mixing weights.

Routing replay keeps a recorded choice of experts and recomputes the weights from the live
router logits, so that the router still gets its gradient. transformers' families spell the
weights in a handful of ways; each is a ``Mixing`` recipe here:

- ``softmax``: a softmax over all experts, the chosen ones' probabilities (Qwen-MoE, Mixtral,
  OLMoE), renormalised over the top-k or not;
- ``softmax_topk``: a softmax over the chosen experts' logits only (gpt-oss, Granite-MoE,
  Cohere2-MoE);
- ``sigmoid``: per-expert sigmoid scores (DeepSeek-V3 and its kin, whose correction bias and
  expert groups steer the selection only; Llama 4's sigmoid of the top-k logits);
- ``sqrtsoftplus``: sqrt(softplus(logits)) (DeepSeek-V4);
- ``probabilities``: the router already returns probabilities (Gemma 4).

then renormalised (with an epsilon or not), scaled (``routed_scaling_factor`` and kin) and
cast to the dtype of the weights the router returned. The recipe of a router is found by
trying them on its own outputs and keeping one that reproduces them bit for bit. Replay
uses it only for a token routed elsewhere than its router chose; a token replayed to its
router's own choice keeps the router's own weights (``honing.models.moe.replayed_weights``).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product

import torch
import torch.nn.functional as F
from torch import nn

ELEMENTWISE = {
    "sigmoid": torch.sigmoid,
    "sqrtsoftplus": lambda x: F.softplus(x).sqrt(),
    "probabilities": lambda x: x,
}
SCORES = ("softmax", "softmax_topk", *ELEMENTWISE)
# where families keep the factor their weights are multiplied by (router, block or config)
SCALE_NAMES = ("routed_scaling_factor", "router_scaling_factor", "route_scale", "moe_scale")


@dataclass(frozen=True)
class Mixing:
    """One recipe for a router's mixing weights from its logits and chosen experts."""

    score: str  # one of SCORES
    normalise: bool  # divided by their sum over the top-k
    eps: float  # added to that sum (DeepSeek-V3: 1e-20), or its floor (``clamp``)
    scale: float  # multiplies the weights
    clamp: bool = False  # the sum clamped to at least ``eps`` (ERNIE 4.5's norm_min)
    # an element-wise score taken of the chosen logits only: the same values as of all
    # logits, but a vectorised kernel may round a tensor of another size differently (an
    # element in its scalar tail); on the large logits a router chooses the two rarely
    # differ, so a probe may not tell them apart
    gathered: bool = False

    def weights(
        self, logits: torch.Tensor, experts: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        """[N, k] weights of ``experts`` [N, k] from ``logits`` [N, S], in ``dtype``."""
        scores = logits.float()
        experts = experts.long()
        if self.score == "softmax_topk":
            weights = scores.gather(-1, experts).softmax(-1)
        elif self.score == "softmax":
            weights = scores.softmax(-1).gather(-1, experts)
        elif self.gathered:
            weights = ELEMENTWISE[self.score](scores.gather(-1, experts))
        else:
            weights = ELEMENTWISE[self.score](scores).gather(-1, experts)
        if self.normalise:
            total = weights.sum(-1, keepdim=True)
            weights = weights / (total.clamp(min=self.eps) if self.clamp else total + self.eps)
        if self.scale != 1.0:
            weights = weights * self.scale
        return weights.to(dtype)


def scales(*holders) -> list[float]:
    """1 and every scaling factor the router, its block or the config name."""
    found = [1.0]
    for holder in holders:
        for name in SCALE_NAMES:
            value = getattr(holder, name, None)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                found.append(float(value))
    return list(dict.fromkeys(found))


def recipes(router: nn.Module, block: nn.Module, config) -> list[Mixing]:
    """Every recipe worth trying on ``router``: each score, plain before renormalised (a
    renormalisation of weights that sum to 1 may change no bit on a small probe), with the
    scales and the floor of the sum it names; an element-wise score of all logits before
    that of the chosen ones (the tensor a router has at hand first: the recipe then does
    the router's own arithmetic on the same tensor, exact on any CPU's kernels, where the
    other may pass a probe by chance)."""
    floor = getattr(router, "norm_min", getattr(block, "norm_min", None))
    sums = [(0.0, False), (1e-20, False), (1e-6, False)]
    if isinstance(floor, float):
        sums.append((floor, True))
    found = []
    for score, normalise, (eps, clamp), scale, gathered in product(
        SCORES, (False, True), sums, scales(router, block, config), (False, True)
    ):
        useful = (
            (normalise or eps == 0.0)
            and gathered <= (score in ELEMENTWISE)
            and not (normalise and score == "softmax_topk")  # its weights sum to 1 already
        )
        if useful:
            found.append(Mixing(score, normalise, eps, scale, clamp, gathered))
    return found


def find_mixing(
    candidates: list[Mixing], *calls: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
) -> Mixing | None:
    """The first of ``candidates`` that reproduces the weights of every one of ``calls``
    (a router call's ``(logits, weights, experts)``) exactly, or None."""
    for recipe in candidates:
        if all(
            torch.equal(recipe.weights(logits.detach(), experts, weights.dtype), weights.detach())
            for logits, weights, experts in calls
        ):
            return recipe
    return None
