"""Mixture-of-experts causal LMs: their top-k routers, what the routers chose, and the replay
of a recorded choice (routing replay), in one place for every family.

transformers' MoE families (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, DeepSeek-V3 and others of
that kind) share one interface: a decoder layer's MoE block has a router module ``gate``
whose forward maps the hidden states to ``(router_logits [N, E], weights [N, k],
experts [N, k])``, and an ``experts`` module that mixes the chosen experts' outputs with
those weights. honing reads and steers routing through forward hooks on the routers, so the
model's own forward, the lean decode step and the packed logprob pass all route the same way.

Replaying a choice keeps the chosen experts and recomputes the mixing weights from the live
router logits, so the router still gets gradients. How a router turns logits into weights is
found, per router, by trying the known recipes on one of its own outputs and keeping the one
that reproduces it exactly: a softmax over the experts or per-expert sigmoid scores
(DeepSeek-V3), the top-k renormalised or not, a scaling factor, cast back to the logits'
dtype or not. A router none of them reproduces cannot be replayed, and the run says so.
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass, field
from itertools import product

import torch
from torch import nn

from honing.models.llama_block import is_moe_block, unwrap


@dataclass(frozen=True)
class Mixing:
    """One recipe for a router's mixing weights from its logits and chosen experts."""

    score: str  # softmax | sigmoid
    normalise: bool
    eps: float  # added to the sum when normalising (DeepSeek-V3: 1e-20)
    scale: float  # multiplies the weights (DeepSeek-V3's routed_scaling_factor)
    cast: bool  # weights cast back to the logits' dtype

    def weights(self, logits: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        scores = logits.float()
        scores = scores.softmax(-1) if self.score == "softmax" else scores.sigmoid()
        weights = scores.gather(-1, experts)
        if self.normalise:
            weights = weights / (weights.sum(-1, keepdim=True) + self.eps)
        if self.scale != 1.0:
            weights = weights * self.scale
        return weights.to(logits.dtype) if self.cast else weights


def _recipes(router: nn.Module) -> list[Mixing]:
    scale = float(getattr(router, "routed_scaling_factor", 1.0) or 1.0)
    norm = getattr(router, "norm_topk_prob", None)
    norms = (True, False) if norm is None else (bool(norm),)
    return [
        Mixing(score, normalise, eps, scale if score == "sigmoid" else 1.0, cast)
        for score, normalise, eps, cast in product(
            ("softmax", "sigmoid"), norms, (0.0, 1e-20), (True, False)
        )
    ]


def find_mixing(router: nn.Module, output) -> Mixing | None:
    """The recipe that reproduces ``output`` (a call's ``(logits, weights, experts)``) of
    ``router`` exactly, or None."""
    logits, weights, experts = output
    for recipe in _recipes(router):
        mine = recipe.weights(logits.detach(), experts)
        if mine.dtype == weights.dtype and torch.equal(mine, weights.detach()):
            return recipe
    return None


@dataclass
class Routers:
    """The top-k routers of an MoE causal LM, one per MoE layer in layer order.

    Attributes:
        model: the transformers model (inside its LoRA wrapper, if any).
        routers: each MoE block's router module.
        blocks: the MoE blocks themselves (``layer.mlp``).
        layer_numbers: the decoder layer of each router (dense layers have none).
        num_experts, top_k: of the routers (the same in every layer).
        family: ``config.model_type``.
    """

    model: nn.Module
    routers: list[nn.Module]
    blocks: list[nn.Module]
    layer_numbers: list[int]
    num_experts: int
    top_k: int
    family: str
    # each router's recipe, by (router number, logits dtype): found on its first output
    mixing: dict[tuple[int, torch.dtype], Mixing | None] = field(default_factory=dict)

    @property
    def layers(self) -> int:
        return len(self.routers)

    @property
    def index_dtype(self) -> torch.dtype:
        """The smallest integer dtype that holds an expert number (and -1: not recorded)."""
        return torch.int8 if self.num_experts <= 127 else torch.int16

    def session(self, **options) -> RoutingSession:
        return RoutingSession(self, **options)

    def load_balancing_loss(self):
        """The family's own load-balancing loss (``load_balancing_loss_func`` of its modeling
        module: Switch-Transformer style, top-k of the live router), or None."""
        module = sys.modules.get(type(self.model).__module__)
        return getattr(module, "load_balancing_loss_func", None)

    def check_replay(self) -> str | None:
        """None when every router's weights can be recomputed for replayed experts, else why
        not (a probe input through each router; a sharded router is checked at its first
        call instead)."""
        from torch.distributed.fsdp import FSDPModule

        if isinstance(self.model, FSDPModule):
            return None
        for number, router in enumerate(self.routers):
            weight = next(router.parameters())
            probe = torch.randn(
                4, weight.shape[-1], generator=torch.Generator().manual_seed(number)
            ).to(weight.device, weight.dtype)
            with torch.no_grad():
                output = router(probe)
            key = (number, output[0].dtype)
            self.mixing[key] = find_mixing(router, output)
            if self.mixing[key] is None:
                return (
                    f"the router {type(router).__name__} (layer {self.layer_numbers[number]}) "
                    "mixes experts in a way honing cannot recompute for replayed experts"
                )
        return None


_FOUND: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def routers_of(model: nn.Module) -> Routers | None:
    """The ``Routers`` of ``model`` (a transformers causal LM, maybe in a LoRA wrapper), or
    None for a dense model. Found once per module."""
    base = unwrap(model)
    if base in _FOUND:
        return _FOUND[base]
    layers = getattr(getattr(base, "model", None), "layers", None)
    found = None
    if isinstance(layers, nn.ModuleList):
        blocks, numbers = [], []
        for number, layer in enumerate(layers):
            block = next((m for m in layer.children() if is_moe_block(m)), None)
            if block is not None:
                blocks.append(block)
                numbers.append(number)
        if blocks:
            routers = [block.gate for block in blocks]
            experts = {
                int(getattr(r, "num_experts", 0) or getattr(b.experts, "num_experts", 0))
                for r, b in zip(routers, blocks, strict=True)
            }
            found = Routers(
                model=base,
                routers=routers,
                blocks=blocks,
                layer_numbers=numbers,
                num_experts=max(experts),
                top_k=routers[0].top_k,
                family=str(getattr(base.config, "model_type", type(base).__name__)),
            )
    _FOUND[base] = found
    return found


@dataclass
class RouterStats:
    """Sums over the tokens a session saw, per MoE layer: expert loads, router entropy, and
    decisions that matched a reference choice. Tensors (no host sync) until ``metrics``."""

    load: torch.Tensor | None = None  # [L, E] tokens routed to each expert
    entropy: torch.Tensor | None = None  # [L] summed router entropy
    tokens: torch.Tensor | None = None  # [L] tokens counted
    matched: torch.Tensor | None = None  # [L] decisions equal to the reference's
    compared: torch.Tensor | None = None  # [L] decisions with a reference

    def sums(self) -> dict[str, torch.Tensor]:
        """Flat named scalars (for a sum across processes); ``host_sums`` reads them."""
        out = {}
        for name in ("load", "entropy", "tokens", "matched", "compared"):
            value = getattr(self, name)
            if value is not None:
                for i, x in enumerate(value.reshape(-1)):
                    out[f"{name}/{i}"] = x
        return out


def host_sums(sums: dict[str, torch.Tensor]) -> dict[str, float]:
    """``RouterStats.sums`` (summed across processes or not) as floats, read from the device
    in one transfer rather than one per expert and layer."""
    names = list(sums)
    if not names:
        return {}
    values = torch.stack([torch.as_tensor(sums[name], dtype=torch.float64) for name in names])
    return dict(zip(names, values.tolist(), strict=True))


def moe_metrics(sums: dict[str, float], layers: int, experts: int) -> dict[str, float]:
    """``moe/...`` metrics from ``RouterStats.sums`` (summed over processes): per layer and
    over layers, the load violation (the busiest expert's share of the routed decisions x
    experts - 1: 0 when balanced), the router entropy (nats, mean per token) and the share of
    decisions whose expert set matched the reference's (the rollout's)."""
    if not sums:
        return {}
    out: dict[str, float] = {}
    violations, entropies = [], []
    for layer in range(layers):
        load = [sums.get(f"load/{layer * experts + e}", 0.0) for e in range(experts)]
        total = sum(load)
        tokens = sums.get(f"tokens/{layer}", 0.0)
        if total > 0:
            violation = max(load) / total * experts - 1
            violations.append(violation)
            out[f"moe/layer{layer}/load_violation"] = violation
        if tokens > 0:
            entropy = sums.get(f"entropy/{layer}", 0.0) / tokens
            entropies.append(entropy)
            out[f"moe/layer{layer}/router_entropy"] = entropy
    if violations:
        out["moe/load_violation/max"] = max(violations)
        out["moe/load_violation/mean"] = sum(violations) / len(violations)
    if entropies:
        out["moe/router_entropy"] = sum(entropies) / len(entropies)
    compared = sum(sums.get(f"compared/{layer}", 0.0) for layer in range(layers))
    if compared > 0:
        matched = sum(sums.get(f"matched/{layer}", 0.0) for layer in range(layers))
        out["moe/rollout_router_match"] = matched / compared
    return out


class RoutingSession:
    """Hooks on every router for the forward passes run inside ``with``.

    Args:
        routers: the model's ``Routers``.
        replay: [N, L, k] experts to use for each of the N tokens the routers will see (in
            the order the forward flattens them) and each MoE layer; a token whose first
            entry is -1 keeps its live choice. None: no replay.
        reference: [N, L, k] a choice to compare the live one with (``stats.matched``);
            entries -1 are not compared.
        real: [N] bool, the tokens counted in ``stats`` and router losses (not padding).
        record: keep the experts used by every call (``recorded``).
        stats: a ``RouterStats`` to add the sums of the passes run inside ``with`` to.
        keep_logits: keep each layer's router logits (with gradient) of the real tokens,
            for router losses (``logits``).

    The routers may be called several times per layer (generation: a prefill, then a call
    per new token): ``recorded[layer]`` lists every call's [n, k] experts in order; a replay
    plan is for one forward pass (one call per layer).
    """

    def __init__(
        self,
        routers: Routers,
        *,
        replay: torch.Tensor | None = None,
        reference: torch.Tensor | None = None,
        real: torch.Tensor | None = None,
        record: bool = False,
        stats: RouterStats | None = None,
        keep_logits: bool = False,
    ):
        self.routers = routers
        self.replay, self.reference, self.real = replay, reference, real
        self.record, self.stats, self.keep_logits = record, stats, keep_logits
        self.recorded: list[list[torch.Tensor]] = [[] for _ in routers.routers]
        self.logits: list[torch.Tensor] = []
        self._handles = []

    def __enter__(self) -> RoutingSession:
        for number, router in enumerate(self.routers.routers):
            self._handles.append(router.register_forward_hook(self._hook(number)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def recorded_calls(self) -> list[torch.Tensor]:
        """Per call, [n, L, k] experts used by each MoE layer (``record``)."""
        calls = len(self.recorded[0]) if self.recorded else 0
        return [torch.stack([layer[call] for layer in self.recorded], 1) for call in range(calls)]

    def _mixing(self, number: int, router: nn.Module, output) -> Mixing:
        known, key = self.routers.mixing, (number, output[0].dtype)
        if known.get(key) is None:
            known[key] = find_mixing(router, output)
        if known[key] is None:
            raise ValueError(
                f"routing replay: the router {type(router).__name__} (layer "
                f"{self.routers.layer_numbers[number]}) mixes experts in a way honing cannot "
                "recompute; set algorithm.routing_replay=off"
            )
        return known[key]

    def _hook(self, number: int):
        def hook(router, args, output):
            logits, weights, experts = output
            live = experts
            changed = False
            if self.replay is not None:
                plan = self._rows(self.replay, number, logits)
                mixing = self._mixing(number, router, output)
                use = plan[:, :1] >= 0
                experts = torch.where(use, plan.to(live.dtype), live)
                weights = mixing.weights(logits, experts)
                changed = True
            if self.record:
                self.recorded[number].append(experts.detach().to(self.routers.index_dtype))
            if self.stats is not None:
                self._count(number, logits.detach(), live, experts)
            if self.keep_logits:
                real = self.real
                self.logits.append(logits if real is None else logits[real])
            return (logits, weights, experts) if changed else None

        return hook

    def _rows(self, plan: torch.Tensor, number: int, logits: torch.Tensor) -> torch.Tensor:
        if plan.shape[0] != logits.shape[0]:
            raise RuntimeError(
                f"routing plan for {plan.shape[0]} tokens; the router saw {logits.shape[0]}"
            )
        return plan[:, number].to(logits.device)

    def _count(self, number, logits, live, used) -> None:
        stats, layers, experts = self.stats, self.routers.layers, self.routers.num_experts
        real = self.real if self.real is not None else torch.ones_like(live[:, 0], dtype=bool)
        real = real.to(live.device)
        if stats.load is None:
            zeros = torch.zeros(layers, device=live.device, dtype=torch.float64)
            stats.load = torch.zeros(layers, experts, device=live.device, dtype=torch.float64)
            stats.entropy, stats.tokens = zeros.clone(), zeros.clone()
            stats.matched, stats.compared = zeros.clone(), zeros.clone()
        chosen = used[real].reshape(-1).long()
        stats.load[number] += torch.bincount(chosen, minlength=experts)[:experts].double()
        logp = logits[real].float().log_softmax(-1)
        stats.entropy[number] += -(logp.exp() * logp).sum().double()
        stats.tokens[number] += real.sum()
        if self.reference is not None:
            reference = self._rows(self.reference, number, logits)
            known = real & (reference[:, 0] >= 0)
            same = (live.sort(-1).values == reference.to(live.dtype).sort(-1).values).all(-1)
            stats.matched[number] += (same & known).sum()
            stats.compared[number] += known.sum()


def router_z_loss(logits: list[torch.Tensor]) -> torch.Tensor:
    """ST-MoE's router z-loss: the mean over tokens of logsumexp(logits)^2, averaged over
    layers."""
    return torch.stack([lg.float().logsumexp(-1).square().mean() for lg in logits]).mean()
