"""Ulysses sequence parallelism: N ranks share one long sequence (DeepSpeed-Ulysses,
https://arxiv.org/abs/2309.14509).

Why: a 32k-token chain of thought may not fit one device's activations. Rank r of the
sequence-parallel (SP) group holds a contiguous slice of T/N tokens, with their global
positions (for RoPE), and runs everything per token on it: embeddings, norms, projections,
the MLP or MoE block, the LM head and the logprobs. Attention needs the whole sequence: in
each layer an all-to-all turns q/k/v from [T/N tokens, H heads] into [T tokens, H/N heads],
attention runs over the whole sequence for those heads, and a second all-to-all turns its
output back into [T/N, H]. Both carry gradients (an all-to-all of equal chunks is its own
transpose), so activations per rank are ~1/N of one process's.

Parameters are replicated over the group. Every rank computes the same loss from the whole
gathered [B, R] logprobs (``sequence_parallel_logprobs``); the gather's backward keeps this
rank's slice only, so each rank's backward gives the gradient through its own tokens and the
SUM over the group's ranks is the one-process gradient (an all-reduce over the SP group).

KV heads fewer than N (or not a multiple of it) are repeated up to a multiple of N before the
exchange; a copy's gradient comes back to the rank owning the token through the reverse
all-to-all and the repeat's backward adds the copies, as one process sums a KV head's
gradient over the query heads reading it. The sequence is padded at its end to a multiple of
N; causal attention hides those tokens from every real one and they predict nothing scored.

The attention is registered under ``ATTENTION`` in transformers' attention registry; given no
``ulysses`` argument (a plain forward, generation) it is transformers' own sdpa attention.
Refused (``check_model``, one-line ``ValueError``): heads N does not divide, sliding windows,
non-causal attention, families outside ``PLAIN_HEAD_MODEL_TYPES`` (logits not
``lm_head(hidden)``, or layers that do not attend through transformers' attention: linear
attention, Mamba, sparse-attention indexers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from honing.models.llama_block import unwrap
from honing.trainer.batch import HEAD_CHUNK_LOGITS, PLAIN_HEAD_MODEL_TYPES
from honing.trainer.head import head_logprobs

ATTENTION = "honing_ulysses"


@dataclass(frozen=True)
class SequenceGroup:
    """The ranks that share one sequence: ``group`` (None: the default group), this process's
    ``rank`` in it and its ``world`` size."""

    group: dist.ProcessGroup | None
    rank: int
    world: int

    @classmethod
    def alone(cls) -> SequenceGroup:
        """One rank: the same computation, no exchange (a reference, or SP off)."""
        return cls(None, 0, 1)

    @classmethod
    def of(cls, group: dist.ProcessGroup | None = None) -> SequenceGroup:
        return cls(group, dist.get_rank(group), dist.get_world_size(group))

    def padded(self, length: int) -> int:
        """``length`` rounded up to a multiple of the world size."""
        return -(-length // self.world) * self.world

    def gathered(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``x`` (of one shape on every rank), in rank order."""
        if self.world == 1:
            return [x]
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return parts

    def bounds(self, length: int) -> tuple[int, int]:
        """This rank's [start, stop) of a ``length`` already ``padded``."""
        share = length // self.world
        return self.rank * share, (self.rank + 1) * share


def check_model(model: nn.Module, world: int) -> None:
    """Raise a one-line ``ValueError`` when ``model`` cannot run over ``world`` SP ranks."""
    config = model.config
    kind = getattr(config, "model_type", None)
    if kind not in PLAIN_HEAD_MODEL_TYPES:
        raise ValueError(
            f"sequence parallelism takes models whose every layer attends through "
            f"transformers' attention and whose logits are lm_head(hidden) "
            f"({', '.join(PLAIN_HEAD_MODEL_TYPES)}), not {kind}"
        )
    heads = config.num_attention_heads
    if heads % world:
        raise ValueError(
            f"num_attention_heads={heads} cannot be split over {world} sequence-parallel "
            "ranks: each rank attends with a whole share of the heads"
        )
    layer_types = getattr(config, "layer_types", None) or ()
    if any("sliding" in layer for layer in layer_types) or (
        getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)
    ):
        raise ValueError("sequence parallelism takes full causal attention, not sliding windows")
    if any(getattr(module, "is_causal", True) is False for module in model.modules()):
        raise ValueError("sequence parallelism takes causal attention only")
    if model.get_output_embeddings().bias is not None:
        raise ValueError("sequence parallelism takes an LM head without a bias")


def use_ulysses(model: nn.Module, world: int) -> nn.Module:
    """Check ``model`` and make its attention the Ulysses one (a plain forward, without the
    ``ulysses`` argument, still runs transformers' sdpa attention)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    check_model(model, world)
    AttentionInterface.register(ATTENTION, _attention(sdpa_attention_forward))
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, sdpa_mask)
    model.set_attn_implementation(ATTENTION)
    return model


class _AllToAll(torch.autograd.Function):
    """All-to-all of equal chunks along dim 0: chunk j goes to rank j; its gradient goes back
    the same way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, sp: SequenceGroup) -> torch.Tensor:
        ctx.sp = sp
        if sp.world == 1:
            return x.clone()
        x = x.contiguous()  # chunks of dim 0 in memory order (a permuted x is not)
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=sp.group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _AllToAll.apply(grad, ctx.sp), None


def to_sequence(parts: list[torch.Tensor], sp: SequenceGroup) -> list[torch.Tensor]:
    """[B, h_i, t, D] of this rank's t tokens -> [B, h_i / N, N * t, D] of the whole sequence,
    each rank the heads' r-th share (one all-to-all for all parts)."""
    batch, _, tokens, dim = parts[0].shape
    chunks = [part.reshape(batch, sp.world, -1, tokens, dim) for part in parts]
    x = torch.cat(chunks, 2).transpose(0, 1)  # [N, B, c, t, D]: share j goes to rank j
    x = _AllToAll.apply(x, sp)  # [N, B, c, t, D]: slice j holds rank j's tokens
    x = x.permute(1, 2, 0, 3, 4).reshape(batch, -1, sp.world * tokens, dim)  # [B, c, T, D]
    return list(x.split([chunk.shape[2] for chunk in chunks], 1))


def to_heads(x: torch.Tensor, sp: SequenceGroup) -> torch.Tensor:
    """[B, h / N, T, D] of the whole sequence -> [B, t, h, D] of this rank's tokens."""
    batch, share, length, dim = x.shape
    tokens = length // sp.world
    x = x.reshape(batch, share, sp.world, tokens, dim).permute(2, 0, 1, 3, 4)  # [N, B, c, t, D]
    x = _AllToAll.apply(x, sp)  # slice j holds rank j's share of heads for this rank's tokens
    return x.permute(1, 3, 0, 2, 4).reshape(batch, tokens, sp.world * share, dim)


def repeat_kv(
    key: torch.Tensor, value: torch.Tensor, sp: SequenceGroup, dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """KV heads (along ``dim``) repeated up to a multiple of N, each copy beside its original,
    so that query head h still reads KV head h // (H / Hkv); the repeat's backward sums the
    copies' gradients."""
    repeat = sp.world // math.gcd(key.shape[dim], sp.world)
    if repeat == 1:
        return key, value
    return key.repeat_interleave(repeat, dim), value.repeat_interleave(repeat, dim)


def _attention(plain):
    """The Ulysses attention, with ``plain`` (transformers' sdpa) for forwards without SP."""

    def ulysses_attention(
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        ulysses: SequenceGroup | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        """q [B, H, t, D], k/v [B, Hkv, t, D] of this rank's tokens; ``attention_mask`` the
        whole sequence's [B, 1, T, T] boolean mask, or None: causal. -> [B, t, H, D]."""
        if ulysses is None:
            return plain(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
        sp = ulysses
        if not getattr(module, "is_causal", True):
            raise ValueError("sequence parallelism takes causal attention only")
        key, value = repeat_kv(key, value, sp, dim=1)
        if value.shape[-1] == query.shape[-1]:
            query, key, value = to_sequence([query, key, value], sp)
        else:  # value heads of another size (multi-head latent attention)
            (query, key), (value,) = to_sequence([query, key], sp), to_sequence([value], sp)
        if attention_mask is not None and attention_mask.shape[-1] != query.shape[2]:
            raise ValueError("a sequence-parallel forward takes the whole sequence's mask")
        out = F.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask=attention_mask,
            dropout_p=dropout,
            scale=scaling,
            is_causal=attention_mask is None,
            enable_gqa=query.shape[1] != key.shape[1],
        )  # [B, H / N, T, Dv]
        return to_heads(out, sp), None

    return ulysses_attention


def whole_mask(
    position_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> torch.Tensor | None:
    """Which keys each query of the whole [B, T] sequence sees: [B, 1, T, T] boolean, or None
    when every row is one sequence without padding (plain causal).

    Causal, within one sequence (a new one starts where the position is not the previous plus
    one: packed rows, as transformers reads them), real keys only (``attention_mask``). A
    query that sees no real key (padding) sees itself: no empty softmax; its output is never
    scored."""
    starts = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1) != 1
    unpadded = attention_mask is None or bool(attention_mask.all())
    if unpadded and not starts.any():
        return None  # causal: no [T, T] mask kept by every layer
    sequence = starts.cumsum(-1)  # [B, T]
    length = position_ids.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=position_ids.device).tril()
    sees = causal & (sequence[:, :, None] == sequence[:, None, :])  # [B, T, T]
    if attention_mask is not None:
        sees &= attention_mask.bool()[:, None, :]
    sees |= torch.eye(length, dtype=torch.bool, device=position_ids.device)
    return sees[:, None]


def local_hidden(
    model: nn.Module,
    sp: SequenceGroup,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The final hidden states [B, t, E] of this rank's slice of the whole [B, T] rows (padded
    at their end to a multiple of N; the pad continues each row's positions). Every rank of
    the group calls it together, on the same rows."""
    length = sp.padded(input_ids.shape[1])
    extra = length - input_ids.shape[1]
    tail = torch.arange(1, extra + 1, device=position_ids.device)
    positions = torch.cat([position_ids, position_ids[:, -1:] + tail], 1)
    if attention_mask is not None:  # the end's padding needs no mask: causality hides it
        attention_mask = F.pad(attention_mask, (0, extra), value=1)
    start, stop = sp.bounds(length)
    decoder = unwrap(model).base_model  # the decoder stack (inside a LoRA wrapper too)
    out = decoder(
        input_ids=F.pad(input_ids, (0, extra))[:, start:stop],
        position_ids=positions[:, start:stop],
        attention_mask=whole_mask(positions, attention_mask),
        use_cache=False,
        ulysses=sp,
    )
    return out.last_hidden_state


class _Gather(torch.autograd.Function):
    """The group's slices [B, t] -> the whole [B, N * t]. Every rank computes the same loss on
    it, so the backward keeps this rank's slice of the gradient (no sum)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, sp: SequenceGroup) -> torch.Tensor:
        ctx.sp = sp
        if sp.world == 1:
            return x.clone()
        return torch.cat(sp.gathered(x), 1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        start, stop = ctx.sp.bounds(grad.shape[1])
        return grad[:, start:stop], None


def gather_sequence(x: torch.Tensor, sp: SequenceGroup) -> torch.Tensor:
    """The group's slices [B, t] of the padded rows -> the whole [B, N * t] on every rank.
    Every rank computes the same loss from it: the backward keeps this rank's slice."""
    return _Gather.apply(x, sp)


def local_head(
    model: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, **options
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``head_logprobs`` (in chunks) of this rank's scored hidden states [n, E] and their
    labels [n] under ``model``'s LM head; ``options``: temperature, with_entropy,
    entropy_grad."""
    weight = model.get_output_embeddings().weight
    chunk = max(1, HEAD_CHUNK_LOGITS // weight.shape[0])
    return head_logprobs(hidden, weight, labels, chunk_tokens=chunk, **options)


def next_token_logprobs(
    model: nn.Module,
    sp: SequenceGroup,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    scored: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprob of the token after each column of the whole [B, T] rows where ``scored`` [B, T]
    is true (0 elsewhere), and the entropy there: [B, T] each, the same on every rank.

    Each rank runs its slice and the head on its scored tokens only (``head_logprobs``, in
    chunks); the results are gathered. Contract: every rank computes the same loss from them;
    the sum of the ranks' gradients is then the one-process gradient."""
    hidden = local_hidden(model, sp, input_ids, position_ids, attention_mask)  # [B, t, E]
    length = sp.padded(input_ids.shape[1])
    extra = length - input_ids.shape[1]
    start, stop = sp.bounds(length)
    labels = F.pad(input_ids[:, 1:], (0, 1 + extra))[:, start:stop]  # [B, t]
    real = F.pad(scored.bool(), (0, extra))[:, start:stop]
    logprobs, entropy = local_head(
        model,
        hidden[real],
        labels[real],
        temperature=temperature,
        with_entropy=with_entropy,
        entropy_grad=entropy_grad,
    )
    width = input_ids.shape[1]

    def whole(values: torch.Tensor) -> torch.Tensor:
        local = torch.zeros(real.shape, dtype=values.dtype, device=values.device)
        return _Gather.apply(local.masked_scatter(real, values), sp)[:, :width]

    return whole(logprobs), None if entropy is None else whole(entropy)


def sequence_parallel_logprobs(
    model: nn.Module,
    batch,
    sp: SequenceGroup,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``response_logprobs`` of a ``TrainBatch`` under SP: the whole [B, R] logprobs (and
    entropy) on every rank, 0 at padding, so the loss and its whole-batch normalisers are
    those of one process (see ``next_token_logprobs`` for the gradient's contract)."""
    width = batch.responses.shape[1]
    first = batch.prompt_width - 1  # column P + r - 1 predicts response token r
    scored = torch.zeros_like(batch.attention_mask, dtype=torch.bool)
    scored[:, first : first + width] = batch.response_mask.bool()
    logprobs, entropy = next_token_logprobs(
        model,
        sp,
        batch.input_ids,
        batch.position_ids,
        scored,
        batch.attention_mask,
        temperature=temperature,
        with_entropy=with_entropy,
        entropy_grad=entropy_grad,
    )
    logprobs = logprobs[:, first : first + width]
    return logprobs, None if entropy is None else entropy[:, first : first + width]
