"""What a mixture-of-experts policy's routers did, summed over a pass: expert loads, router
entropy, agreement with the rollout's choice, and the ``moe/...`` metrics made of them.

A router may choose, beside its experts, null slots: zero experts that add nothing
(LongCat-Flash) or a skip expert (ZAYA). They are counted in slots of their own after the
experts, so a token sent to one is neither dropped nor counted as load on an expert.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RouterStats:
    """Sums over the tokens a session saw, per MoE layer: loads of every slot (the experts,
    then the null slots), router entropy, and decisions that matched a reference choice.
    Tensors (no host sync) until ``moe_metrics``."""

    load: torch.Tensor | None = None  # [L, S] tokens routed to each slot
    entropy: torch.Tensor | None = None  # [L] summed router entropy
    tokens: torch.Tensor | None = None  # [L] tokens counted
    matched: torch.Tensor | None = None  # [L] decisions equal to the reference's
    compared: torch.Tensor | None = None  # [L] decisions with a reference

    def add(
        self,
        layer: int,
        shape: tuple[int, int],
        logits: torch.Tensor,
        used: torch.Tensor,
        live: torch.Tensor,
        reference: torch.Tensor | None,
    ) -> None:
        """Count one router call of ``layer`` (``shape``: layers, slots) over its real
        tokens: ``used`` [n, k] the slots the block was given, ``live`` those the router
        chose, ``reference`` [n, k] a choice to compare with (-1: none)."""
        if self.load is None:
            zeros = torch.zeros(shape[0], device=used.device, dtype=torch.float64)
            self.load = torch.zeros(shape, device=used.device, dtype=torch.float64)
            self.entropy, self.tokens = zeros.clone(), zeros.clone()
            self.matched, self.compared = zeros.clone(), zeros.clone()
        slots = shape[1]
        self.load[layer] += torch.bincount(used.reshape(-1).long(), minlength=slots)[:slots]
        logp = logits.float().log_softmax(-1)
        self.entropy[layer] += -(logp.exp() * logp).sum().double()
        self.tokens[layer] += used.shape[0]
        if reference is not None:
            known = reference[:, 0] >= 0
            same = (live.sort(-1).values == reference.to(live.dtype).sort(-1).values).all(-1)
            self.matched[layer] += (same & known).sum()
            self.compared[layer] += known.sum()

    FIELDS = ("load", "entropy", "tokens", "matched", "compared")

    def include(self, other: RouterStats) -> None:
        """Adds ``other``'s sums (of the same layers and slots) to these."""
        for name in self.FIELDS:
            mine, theirs = getattr(self, name), getattr(other, name)
            if theirs is not None:
                setattr(self, name, theirs.clone() if mine is None else mine + theirs)

    def sums(self) -> dict[str, torch.Tensor]:
        """Flat named scalars (for a sum across processes); ``host_sums`` reads them."""
        out = {}
        for name in self.FIELDS:
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


def moe_metrics(sums: dict[str, float], layers: int, experts: int, null: int = 0) -> dict:
    """``moe/...`` metrics from ``RouterStats.sums`` (summed over processes): per layer and
    over layers, the load violation (the busiest expert's share of the decisions routed to
    experts x experts - 1: 0 when balanced), the router entropy (nats, mean per token), the
    share of decisions sent to the ``null`` slots after the ``experts`` (where the family has
    them) and the share of decisions whose expert set matched the reference's (the
    rollout's)."""
    if not sums:
        return {}
    out: dict[str, float] = {}
    violations, entropies = [], []
    slots = experts + null
    routed = nulled = 0.0
    for layer in range(layers):
        load = [sums.get(f"load/{layer * slots + e}", 0.0) for e in range(slots)]
        total = sum(load[:experts])
        routed, nulled = routed + total, nulled + sum(load[experts:])
        tokens = sums.get(f"tokens/{layer}", 0.0)
        if total > 0:
            violation = max(load[:experts]) / total * experts - 1
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
    if null and routed + nulled > 0:
        out["moe/null_expert_share"] = nulled / (routed + nulled)
    compared = sum(sums.get(f"compared/{layer}", 0.0) for layer in range(layers))
    if compared > 0:
        matched = sum(sums.get(f"matched/{layer}", 0.0) for layer in range(layers))
        out["moe/rollout_router_match"] = matched / compared
    return out


def router_z_loss(logits: list[torch.Tensor]) -> torch.Tensor:
    """ST-MoE's router z-loss: the mean over tokens of logsumexp(logits)^2, averaged over
    layers."""
    return torch.stack([lg.float().logsumexp(-1).square().mean() for lg in logits]).mean()
