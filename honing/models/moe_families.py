"""How honing reads each transformers mixture-of-experts family's routers: the common form,
and one small named adapter per family that departs from it.

The common form (most families): a module with an ``experts`` child and a router child named
``gate`` or ``router`` is an MoE block; the router's forward returns ``(logits [N, S],
weights [N, k], experts [N, k])``; top_k and the number of experts are on the router, the
block or the config. An adapter changes only what its family does otherwise: where the router
sits, what its forward returns (``Form``), extra recipes for its weights, null slots after the
experts, layers whose routing needs no replay (hash-routed), or why its choice cannot be
replayed exactly (``refused``: routing replay is then refused at the start, in one line, while
the routing metrics and router losses still work).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from honing.models.moe_mixing import Mixing, recipes

ROUTER_NAMES = ("gate", "router")
EXPERT_COUNT_NAMES = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
TOP_K_NAMES = ("top_k", "num_experts_per_tok", "moe_topk", "moe_k", "top_k_experts")


Choice = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # logits [N, S], weights, experts [N, k]


def _tokens(t: torch.Tensor) -> int:
    return t.numel() // max(t.shape[-1], 1) if t.dim() else 0


def flat_tokens(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


class Form:
    """How a router's forward output carries its choice. The common form finds the parts by
    what they are, so that the order a transformers version returns them in does not matter:
    the experts are the integer tensor, the weights the float one of the same shape, the
    logits the float one with a value per token over all slots. A router that returns only
    its logits leaves the choice to its block, which hands it to the ``experts`` call
    (``read`` is None; the session takes the choice there)."""

    def _places(self, output) -> tuple[int, int, int] | None:
        values = output if isinstance(output, tuple) else (output,)
        tensors = [(i, v) for i, v in enumerate(values) if isinstance(v, torch.Tensor)]
        experts = next((i for i, v in tensors if not v.is_floating_point()), None)
        if experts is None:
            return None
        shape, tokens = values[experts].shape, _tokens(values[experts])
        floats = [(i, v) for i, v in tensors if v.is_floating_point()]
        weights = next((i for i, v in floats if v.shape == shape), None)
        logits = next((i for i, v in floats if i != weights and _tokens(v) == tokens), None)
        return None if weights is None or logits is None else (logits, weights, experts)

    def read(self, output, top_k: int) -> Choice | None:
        """The call's choice, or None where the output holds none (or none honing reads)."""
        places = self._places(output)
        if places is None:
            return None
        return tuple(flat_tokens(output[i]) for i in places)

    def logits(self, output) -> torch.Tensor | None:
        """The logits of a router that returns only those (its block chooses), else None."""
        values = output if isinstance(output, tuple) else (output,)
        tensors = [v for v in values if isinstance(v, torch.Tensor)]
        if len(tensors) != 1 or not tensors[0].is_floating_point():
            return None
        return flat_tokens(tensors[0])

    def write(self, output, weights: torch.Tensor, experts: torch.Tensor):
        _, at_weights, at_experts = self._places(output)
        values = list(output)
        values[at_weights] = weights.view(output[at_weights].shape)
        values[at_experts] = experts.view(output[at_experts].shape)
        return tuple(values)


class SkipFolded(Form):
    """ZAYA: a router with a skip slot after its experts returns a token sent there as
    expert 0 with weight 0. Read back as the skip slot (a softmax weight is never exactly 0
    otherwise), written back folded."""

    def read(self, output, top_k: int) -> Choice | None:
        choice = super().read(output, top_k)
        if choice is None:
            return None
        logits, weights, experts = choice
        return logits, weights, torch.where(weights == 0, logits.shape[-1] - 1, experts)

    def write(self, output, weights: torch.Tensor, experts: torch.Tensor):
        skip = experts == output[0].shape[-1] - 1
        return super().write(output, weights.masked_fill(skip, 0), experts.masked_fill(skip, 0))


class DenseScores(Form):
    """Llama 4: the router returns ``(scores [N, E], logits [N, E])``, the scores the
    sigmoid of the top-k logits in their experts' columns and 0 elsewhere, and the block
    runs every expert on its score."""

    def read(self, output, top_k: int) -> Choice:
        scores, logits = output
        experts = scores.topk(top_k, dim=-1).indices
        return logits, scores.gather(-1, experts), experts

    def write(self, output, weights: torch.Tensor, experts: torch.Tensor):
        scores, logits = output
        return torch.zeros_like(scores).scatter(-1, experts, weights), logits


def _attribute(names: tuple[str, ...], *holders) -> int | None:
    for holder in holders:
        for name in names:
            value = getattr(holder, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


@dataclass(frozen=True)
class Scaled:
    """A recipe whose weights are multiplied by a per-expert scale the router holds (Gemma 4's
    ``per_expert_scale``: a parameter, so replayed weights carry its gradient too)."""

    base: Mixing
    scale: torch.Tensor

    def weights(self, logits, experts, dtype) -> torch.Tensor:
        return self.base.weights(logits, experts, dtype) * self.scale[experts.long()]


@dataclass(frozen=True)
class NullZeroed:
    """A recipe whose weights are 0 on the null slots from ``first`` on (ZAYA's skip)."""

    base: Mixing
    first: int

    def weights(self, logits, experts, dtype) -> torch.Tensor:
        weights = self.base.weights(logits, experts, dtype)
        return weights.masked_fill(experts >= self.first, 0)


@dataclass(frozen=True)
class Family:
    """How honing reads one family's routers (the defaults: the common form)."""

    router_names: tuple[str, ...] = ROUTER_NAMES
    form: Form = Form()
    refused: str | None = None  # why its choice cannot be replayed exactly
    # the null slots after the experts: a config field counting them, or "skip": one
    null_slots: str | None = None
    hash_routed: str | None = None  # a router attribute that is set on hash-routed layers
    per_expert_scale: str | None = None  # a router parameter scaling each expert's weight
    probabilities: bool = False  # its "logits" are probabilities (metrics take their log)

    def block(self, module: nn.Module) -> nn.Module | None:
        """``module`` if it is an MoE block: an ``experts`` child beside a router."""
        experts = getattr(module, "experts", None)
        if not isinstance(experts, nn.Module) or isinstance(module, nn.ModuleList):
            return None
        return module if self.router(module) is not None else None

    def router(self, block: nn.Module) -> nn.Module | None:
        for name in self.router_names:
            router = getattr(block, name, None)
            if isinstance(router, nn.Module):
                return router
        return None

    def num_experts(self, router: nn.Module, block: nn.Module, config) -> int:
        experts = block.experts
        found = _attribute(EXPERT_COUNT_NAMES, experts, router, block, config)
        return found or len(experts)

    def top_k(self, router: nn.Module, block: nn.Module, config) -> int:
        found = _attribute(TOP_K_NAMES, router, block, config)
        if found is None:
            raise ValueError(f"{type(block).__name__}: no top_k on its router, block or config")
        return found

    def null_experts(self, config) -> int:
        if self.null_slots == "skip":
            return 1
        return int(getattr(config, self.null_slots, 0) or 0) if self.null_slots else 0

    def recipes(self, router: nn.Module, block: nn.Module, config) -> list:
        found = recipes(router, block, config)
        if self.per_expert_scale:
            scale = getattr(router, self.per_expert_scale)
            found = [Scaled(recipe, scale) for recipe in found]
        if self.null_slots == "skip":
            experts = self.num_experts(router, block, config)
            found = [NullZeroed(recipe, experts) for recipe in found]
        return found

    def hashed(self, router: nn.Module) -> bool:
        return bool(self.hash_routed) and hasattr(router, self.hash_routed)


COMMON = Family()

# one entry per family that departs from the common form; each says how and why
FAMILIES: dict[str, Family] = {
    # the router returns (scores, logits): the sigmoid of the top-k logits scattered in
    # their experts' columns, which the block multiplies into every expert's input
    "llama4_text": Family(form=DenseScores()),
    "llama4": Family(form=DenseScores()),
    # LongCat-Flash's zero experts: logits over E + zero_expert_num slots; a token sent to a
    # zero expert keeps its hidden state, scaled by the slot's weight
    "longcat_flash": Family(null_slots="zero_expert_num"),
    # ZAYA's skip slot: its router picks among E + 1 classes and folds a skip into expert 0
    # with weight 0 (SkipFolded); its routers also hand their state to the next layer's
    "zaya": Family(form=SkipFolded(), null_slots="skip"),
    # Gemma 4: router and experts on the decoder layer itself; the router returns
    # probabilities, and scales each chosen expert's weight by a learned per-expert factor
    "gemma4_text": Family(per_expert_scale="per_expert_scale", probabilities=True),
    # DeepSeek-V4's first layers route by a table of token ids (``tid2eid``): the same
    # tokens choose the same experts in every pass, so there is nothing to replay there
    "deepseek_v4": Family(hash_routed="tid2eid"),
    "phimoe": Family(
        refused="routes with sparsemixer, which in training mode draws each token's experts "
        "at random (a Gumbel sample) and weights them by a randomised estimator, so the "
        "update pass cannot use the rollout's choice"
    ),
    "inkling_text": Family(
        refused="normalises the chosen experts' weights together with its shared experts' "
        "gates inside the router, which honing does not recompute for replayed experts"
    ),
}

# families whose MoE layers honing does not read, with why (the runs that need them say so)
NOT_ROUTED: dict[str, str] = {
    "doge": "routes through product keys inside its MoE block, with no router module",
    "jetmoe": "routes its attention heads as well as its MLP, and its routers hand the "
    "experts token lists sorted by expert rather than a top-k choice per token",
}


def family_of(model: nn.Module) -> Family | None:
    """The adapter of ``model``'s family (``config.model_type``), the common form, or None
    for a family listed in ``NOT_ROUTED``."""
    family = getattr(model.config, "model_type", None)
    return None if family in NOT_ROUTED else FAMILIES.get(family, COMMON)
