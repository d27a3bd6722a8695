"""Mixture-of-experts causal LMs: their top-k routers, what the routers chose, and the replay
of a recorded choice (routing replay), in one place for every family.

A decoder layer of a transformers MoE family holds an MoE block: a module with an ``experts``
child and a router child (``gate``, ``router``, ...) whose forward maps the hidden states to
its logits and the experts chosen for each token with their mixing weights. The block sits
where the family puts it (``mlp``, ``block_sparse_moe``, ``feed_forward``, ``mixer``, the
layer itself) and the layers where the model keeps them (``model.layers``,
``transformer.blocks``), so discovery walks the model for such blocks rather than follow one
naming habit. How a family's router output carries its choice, and what cannot be replayed
exactly, is that family's adapter (``honing.models.moe_families``); the loop knows nothing of
them.

honing reads and steers routing through forward hooks on the routers, so the model's own
forward, the lean decode step and the packed logprob pass all route the same way. Replaying a
choice keeps the chosen experts and takes their mixing weights from the live router: its own
weights where a token's planned experts are the ones it chose (so replaying its own choice
changes no bit), else recomputed from its live logits by its recipe
(``honing.models.moe_mixing``); either way the router still gets gradients.
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import __version__ as _transformers_version

from honing.models.llama_block import unwrap
from honing.models.moe_families import Family, family_of, flat_tokens
from honing.models.moe_mixing import Mixing, find_mixing
from honing.models.moe_stats import RouterStats

PROBE_TOKENS = 16  # the forward check_replay runs
PROBE_SIZES = 40  # the router's own calls it runs after, of 1 to 40 tokens


@dataclass
class Routers:
    """The top-k routers of an MoE causal LM, one per MoE layer in layer order.

    Attributes:
        model: the transformers model (inside its LoRA wrapper, if any).
        routers: each MoE block's router module.
        blocks: the MoE blocks themselves.
        layer_numbers: the decoder layer of each router (dense layers have none).
        num_experts, top_k: of the routers (the same in every layer).
        null_experts: slots after the experts a router may choose that compute nothing
            (zero experts, a skip expert), counted in the loads as what they are.
        family: ``config.model_type``; ``adapter``: how honing reads its routers.
    """

    model: nn.Module
    routers: list[nn.Module]
    blocks: list[nn.Module]
    layer_numbers: list[int]
    num_experts: int
    top_k: int
    family: str
    adapter: Family
    null_experts: int = 0
    # each router's recipe, by (router number, logits dtype): found on its first output
    mixing: dict[tuple[int, torch.dtype], Mixing | None] = field(default_factory=dict)

    @property
    def layers(self) -> int:
        return len(self.routers)

    @property
    def slots(self) -> int:
        return self.num_experts + self.null_experts

    @property
    def index_dtype(self) -> torch.dtype:
        """The smallest integer dtype that holds a slot number (and -1: not recorded)."""
        return torch.int8 if self.slots <= 127 else torch.int16

    def session(self, **options) -> RoutingSession:
        return RoutingSession(self, **options)

    def load_balancing_loss(self):
        """The family's own load-balancing loss (``load_balancing_loss_func`` of its modeling
        module: Switch-Transformer style, top-k of the live router), or None. The module is
        the model class's, or its base's where FSDP has made the model a subclass of it."""
        for cls in type(self.model).__mro__:
            found = getattr(sys.modules.get(cls.__module__), "load_balancing_loss_func", None)
            if found is not None:
                return found
        return None

    def mixing_of(self, number: int, *calls) -> Mixing | None:
        """The recipe of router ``number``, found on ``calls`` (its ``(logits, weights,
        experts)``) the first time their logits' dtype is seen."""
        key = (number, calls[0][0].dtype)
        if key not in self.mixing:
            router, block = self.routers[number], self.blocks[number]
            candidates = self.adapter.recipes(router, block, self.model.config)
            self.mixing[key] = find_mixing(candidates, *calls)
        return self.mixing[key]

    def check_replay(self) -> str | None:
        """None when every router's choice can be replayed exactly, else why not: the
        family's adapter refuses it, a router runs other than once per forward, or no recipe
        recomputes its weights. Checked on a forward of a few tokens (a sharded model is
        checked at its first call instead)."""
        from torch.distributed.fsdp import FSDPModule

        if self.adapter.refused:
            return f"the {self.family} family {self.adapter.refused}"
        if isinstance(self.model, FSDPModule):
            return None
        vocab = self.model.get_input_embeddings().weight.shape[0]
        device = next(self.model.parameters()).device
        training = self.model.training
        self.model.eval()  # some families jitter their routers' input in training mode
        try:
            with torch.no_grad(), self.session(probe=True) as session:
                self.model(input_ids=(torch.arange(PROBE_TOKENS, device=device) % vocab)[None])
        finally:
            self.model.train(training)
        for number, router in enumerate(self.routers):
            where = (
                f"the {self.family} family's router {type(router).__name__} (layer "
                f"{self.layer_numbers[number]})"
            )
            calls = session.seen[number]
            if number in session.unread:
                return (
                    f"{where} returns no top-k choice with its logits that honing "
                    f"reads in transformers {_transformers_version}"
                )
            if len(calls) != 1:
                return (
                    f"{where} runs {len(calls)} times per forward pass; a recorded choice "
                    "holds one call per layer"
                )
            if self.adapter.hashed(router):
                continue
            if session.inputs[number]:  # the router chooses: more calls of other sizes
                calls += self._calls_of_sizes(router, *session.inputs[number][0])
            if self.mixing_of(number, *calls) is None:
                return (
                    f"{where} mixes experts in a way honing cannot recompute for replayed experts"
                )
        return None

    def _calls_of_sizes(self, router: nn.Module, args: tuple, kwargs: dict) -> list[tuple]:
        """``router``'s ``(logits, weights, experts)`` on random hidden states of 1 to
        ``PROBE_SIZES`` tokens (its other inputs as the forward gave them): a recipe that
        equals the router's arithmetic only on some tensor sizes (a vectorised kernel rounds
        an element differently in a loop's tail) shows itself on one of them."""
        hidden = args[0]
        lead = hidden.shape[:-1]
        generator = torch.Generator(device=hidden.device).manual_seed(0)
        calls = []

        def resized(value, tokens: int):
            """A random stand-in of ``tokens`` tokens for a float input shaped per token."""
            if not isinstance(value, torch.Tensor) or value.shape[:-1] != lead:
                return value
            shape = (*[1] * (value.dim() - 2), tokens, value.shape[-1])
            x = torch.randn(shape, generator=generator, device=value.device)
            return x.to(value.dtype)

        with torch.no_grad():
            for tokens in range(1, PROBE_SIZES + 1):
                output = router(
                    *(resized(a, tokens) for a in args),
                    **{k: resized(v, tokens) for k, v in kwargs.items()},
                )
                calls.append(self.adapter.form.read(output, self.top_k))
        return calls


def replayed_weights(
    mixing: Mixing,
    logits: torch.Tensor,
    weights: torch.Tensor,
    live: torch.Tensor,
    used: torch.Tensor,
) -> torch.Tensor:
    """[N, k] mixing weights of the replayed experts ``used``: where a token's planned
    experts are the ones its router chose (``live``, in any order), the router's own
    ``weights``; elsewhere the recipe's, from the live ``logits``.

    Replaying the router's own choice thus hands the experts the very weights the router
    computed, bit for bit on any CPU's kernels: a recipe equals the router's arithmetic only
    as far as a probe shows (a vectorised kernel rounds an element of its scalar tail
    differently, so a recipe taken over another tensor shape can agree on every probe and
    still differ by an ulp on one token of another call). The recipe is needed, and used,
    only for a token routed elsewhere than its router chose."""
    same = used[:, :, None] == live[:, None, :]  # [N, k, k]: planned slot i is live slot j
    own = same.any(-1).all(-1, keepdim=True) & same.any(-2).all(-1, keepdim=True)  # [N, 1]
    slot = same.int().argmax(-1)  # [N, k]: the live slot of each planned expert
    recomputed = mixing.weights(logits, used, weights.dtype)
    return torch.where(own, weights.gather(-1, slot), recomputed)


def _choice_like(index, weights) -> bool:
    """An experts call's ``(top_k_index, top_k_weights)``: integers and floats, one shape."""
    return (
        isinstance(index, torch.Tensor)
        and isinstance(weights, torch.Tensor)
        and not index.is_floating_point()
        and weights.is_floating_point()
        and index.shape == weights.shape
    )


_FOUND: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def routers_of(model: nn.Module) -> Routers | None:
    """The ``Routers`` of ``model`` (a transformers causal LM, maybe in a LoRA wrapper), or
    None for a dense model. Found once per module."""
    base = unwrap(model)
    if base not in _FOUND:
        _FOUND[base] = _find(base)
    return _FOUND[base]


def _find(base: nn.Module) -> Routers | None:
    adapter = family_of(base)
    if adapter is None:
        return None
    found = []  # (layer number, block, router)
    for name, module in base.named_modules():
        block = adapter.block(module)
        if block is None:
            continue
        numbers = [int(part) for part in name.split(".") if part.isdigit()]
        router = adapter.router(block)
        if router is not None:
            found.append((numbers[0] if numbers else 0, block, router))
    if not found:
        return None
    config = base.config
    routers = [router for _, _, router in found]
    blocks = [block for _, block, _ in found]
    return Routers(
        model=base,
        routers=routers,
        blocks=blocks,
        layer_numbers=[number for number, _, _ in found],
        num_experts=max(
            adapter.num_experts(r, b, config) for r, b in zip(routers, blocks, strict=True)
        ),
        top_k=adapter.top_k(routers[0], blocks[0], config),
        family=str(getattr(config, "model_type", type(base).__name__)),
        adapter=adapter,
        null_experts=adapter.null_experts(config),
    )


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
        probe: bool = False,
    ):
        self.routers = routers
        self.replay, self.reference, self.real = replay, reference, real
        self.record, self.stats, self.keep_logits = record, stats, keep_logits
        self.recorded: list[list[torch.Tensor]] = [[] for _ in routers.routers]
        self.logits: list[torch.Tensor] = []
        self.probe = probe  # keep every call's (logits, weights, experts) in ``seen``
        self.seen: list[list[tuple]] = [[] for _ in routers.routers]
        self.inputs: list[list[tuple]] = [[] for _ in routers.routers]  # the router's args
        self._pending: dict[int, torch.Tensor] = {}  # logits of routers whose block chooses
        self.unread: set[int] = set()  # routers whose choice honing found no way to read
        self._handles = []

    def __enter__(self) -> RoutingSession:
        for number, (router, block) in enumerate(
            zip(self.routers.routers, self.routers.blocks, strict=True)
        ):
            self._handles.append(
                router.register_forward_hook(self._router_hook(number), with_kwargs=True)
            )
            self._handles.append(
                block.experts.register_forward_pre_hook(
                    self._experts_hook(number), with_kwargs=True
                )
            )
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._pending.clear()

    def recorded_calls(self) -> list[torch.Tensor]:
        """Per call, [n, L, k] experts used by each MoE layer (``record``)."""
        calls = len(self.recorded[0]) if self.recorded else 0
        return [torch.stack([layer[call] for layer in self.recorded], 1) for call in range(calls)]

    def _router_hook(self, number: int):
        def hook(router, args, kwargs, output):
            form = self.routers.adapter.form
            choice = form.read(output, self.routers.top_k)
            if choice is None:  # the block chooses: the session takes it at the experts
                logits = form.logits(output)
                if logits is None:
                    self.unread.add(number)
                else:
                    self._pending[number] = logits
                return None
            if self.probe:
                self.inputs[number].append((args, kwargs))
            changed = self._route(number, *choice)
            return None if changed is None else form.write(output, *changed)

        return hook

    def _experts_hook(self, number: int):
        def hook(experts, args, kwargs):
            logits = self._pending.pop(number, None)
            if logits is None:
                return None
            named = "top_k_index" in kwargs
            index = kwargs["top_k_index"] if named else args[1] if len(args) > 2 else None
            weights = (
                kwargs.get("top_k_weights") if named else args[2] if index is not None else None
            )
            if not _choice_like(index, weights):  # experts that route for themselves
                self.unread.add(number)
                return None
            changed = self._route(number, logits, flat_tokens(weights), flat_tokens(index))
            if changed is None:
                return None
            weights, index = changed[0].view(weights.shape), changed[1].view(index.shape)
            if named:
                return args, kwargs | {"top_k_index": index, "top_k_weights": weights}
            return (args[0], index, weights, *args[3:]), kwargs

        return hook

    def _route(self, number: int, logits, weights, live):
        """One router call's choice: recorded, counted, replayed. Returns the replayed
        ``(weights, experts)``, or None when the live choice stands."""
        routers = self.routers
        if self.probe:
            self.seen[number].append((logits.detach(), weights.detach(), live))
        used, changed = live, None
        if self.replay is not None and not routers.adapter.hashed(routers.routers[number]):
            plan = self._rows(self.replay, number, live)
            mixing = routers.mixing_of(number, (logits, weights, live))
            if mixing is None:
                raise ValueError(
                    f"routing replay: the router {type(routers.routers[number]).__name__} "
                    f"(layer {routers.layer_numbers[number]}) mixes experts in a way honing "
                    "cannot recompute; set algorithm.routing_replay=off"
                )
            used = torch.where(plan[:, :1] >= 0, plan.to(live.dtype), live)
            changed = replayed_weights(mixing, logits, weights, live, used), used
        if self.record:
            self.recorded[number].append(used.detach().to(routers.index_dtype))
        if self.stats is not None or self.keep_logits:
            if routers.adapter.probabilities:  # their log: logits of the same softmax
                logits = logits.float().clamp_min(torch.finfo(torch.float32).tiny).log()
            real = self.real.to(live.device) if self.real is not None else None
            pick = (lambda t: t) if real is None else (lambda t: t[real])
            if self.stats is not None:
                reference = None
                if self.reference is not None:
                    reference = pick(self._rows(self.reference, number, live))
                shape = (routers.layers, routers.slots)
                self.stats.add(
                    number, shape, pick(logits.detach()), pick(used), pick(live), reference
                )
            if self.keep_logits:
                self.logits.append(pick(logits))
        return changed

    def _rows(self, plan: torch.Tensor, number: int, live: torch.Tensor) -> torch.Tensor:
        if plan.shape[0] != live.shape[0]:
            raise RuntimeError(
                f"routing plan for {plan.shape[0]} tokens; the router saw {live.shape[0]}"
            )
        return plan[:, number].to(live.device)
