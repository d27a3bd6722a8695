"""Response logprobs with each prompt run once per group and no padding (Llama-family models).

Why: a GRPO batch holds ``group_size`` completions of every prompt, and the padded layout of
``TrainBatch`` runs each prompt once per completion, plus the padding up to the longest
prompt and the longest response. On the peer benchmark (8 prompts x 8 completions) that is
1,600 positions of which ~700 are distinct real work; with long prompts (math problems, code
with tests) the shared prompt dominates. Here the forward runs on a flat stream of tokens:
every distinct prompt once, then each row's response tokens (less the last, which predicts
nothing). Norms, projections and the MLP see only those tokens; attention gathers each
row's keys (its group's prompt, then its own response so far) into a padded block, so a
response token attends to exactly what it attends to in the padded forward. Through the
gather's backward, the gradients of every completion reach their shared prompt's tokens
and are summed there, as the padded forward sums them over identical copies.

It is the Hugging Face forward's arithmetic (``honing.models.llama_block``), so logprobs,
entropies and gradients equal those of ``model(...)`` up to floating-point reassociation
(tests/trainer/test_packed.py compares them, LoRA adapters included). Models the lean block
does not cover, gradient checkpointing, and attention or LoRA dropout in training fall back to
the model's own forward (``packed_supported`` says why).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from honing.models.llama_block import (
    head_norms,
    is_moe_block,
    moe_forward,
    norm_heads,
    norm_of,
    project,
    projection,
    rms_norm,
    rotary,
    rotate,
    supports,
    unwrap,
)
from honing.models.loading import activation_checkpointing
from honing.trainer.head import head_logprobs


def packed_supported(model: nn.Module) -> bool | str:
    """True when the packed forward computes exactly what ``model``'s forward does (a LoRA
    wrapper included: small adapted q/k/v and gate/up enter merged into their stacked matrix,
    through which the adapters' gradients flow; the others run PEFT's own forward)."""
    if is_sharded(model):
        return "the model is sharded (trainer.strategy=fsdp): its layers gather their weights"
    reason = supports(model)
    if reason is not True:
        return reason
    base = unwrap(model)
    if activation_checkpointing(base):
        return "gradient checkpointing is on"
    if model.training and getattr(base.config, "attention_dropout", 0.0):
        return "attention dropout in training"
    if model.training and any(
        getattr(adapter, "lora_dropout", 0.0)
        for adapter in getattr(model, "peft_config", {}).values()
    ):
        return "LoRA dropout in training"
    if base.lm_head.bias is not None:
        return "the LM head has a bias"
    return True


def is_sharded(model: nn.Module) -> bool:
    """Whether FSDP shards ``model``: its weights are whole only inside its own forward
    passes, so paths that read them directly (the packed forward, the chunked head) cannot
    run on it."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


@dataclass
class PackedLayout:
    """Where each token of a ``TrainBatch`` goes in the flat stream (built on the host).

    ``N`` flat tokens: the distinct prompts' tokens, then each row's response tokens but the
    last. Padding slots of the gathers point at token 0 (masked out or dropped).

    Attributes:
        ids, positions: [N] token ids and rotary positions of the flat stream.
        query_slots: [U + B, Q] the queries of each attention row: a distinct prompt's tokens
            (U rows), then a row's response inputs (B rows); Q = max(Pm, Rm).
        key_slots: [U + B, Pm + Rm] their keys: the prompt (and nothing), or the row's
            group's prompt then its response inputs.
        sees: [U + B, 1, Q, Pm + Rm] which keys a query attends to: causal, real keys only;
            a padding query sees key 0 (no empty softmax; its output is dropped). Boolean,
            as scaled_dot_product_attention takes it; ``additive`` makes the 0 / -inf form.
            None when ``causal``.
        causal: each row is one block of its own (its prompt, then its response inputs,
            padded at the end) in which plain causal attention is exact: real queries come
            first and never see the padding after them. No mask is made (a long row's
            [T, T] mask would outweigh its activations) and no padded prompt block is run.
            Rows that share a prompt gather its one copy in the stream as keys and queries;
            the prompt's output is read from one of their blocks. Chosen where it scores no
            more query-key pairs than the shared blocks (``_rows_score_less``).
        dtype: the model's dtype (of the additive form).
        unpad: [N] where each flat token's attention output sits in the flattened blocks.
        predictors: [T] the flat token whose hidden state predicts each real response token
            (row-major, as ``response_mask`` orders them).
        sources: [N] where each flat token sits in the flattened [B * (P + R)] batch (the
            first row of a shared prompt): a per-token plan of the batch (routing replay)
            gathered into the stream's order.
        places: [B * (P + R)] the flat token each batch position runs as, -1 where none
            (padding, each row's last response token): the stream scattered back.
    """

    ids: torch.Tensor
    positions: torch.Tensor
    query_slots: torch.Tensor
    key_slots: torch.Tensor
    sees: torch.Tensor | None
    dtype: torch.dtype
    unpad: torch.Tensor
    predictors: torch.Tensor
    sources: torch.Tensor
    places: torch.Tensor
    causal: bool = False
    _additive: torch.Tensor | None = None

    def additive(self) -> torch.Tensor:
        """``sees`` as 0 / -inf in the model dtype, [U + B, 1, 1, Q, K] (made once; [1, 1, 1,
        Q, K] when ``causal``)."""
        if self._additive is None:
            sees = self.sees
            if sees is None:
                queries, keys = self.query_slots.shape[1], self.key_slots.shape[1]
                sees = torch.ones(queries, keys, dtype=torch.bool, device=self.ids.device)
                sees = sees.tril()[None, None]
            bias = torch.zeros(sees.shape, dtype=self.dtype, device=sees.device)
            self._additive = bias.masked_fill_(~sees, float("-inf"))[:, :, None]
        return self._additive

    def to_batch(self, values: torch.Tensor, fill) -> torch.Tensor:
        """Per-token ``values`` of the stream ([N, ...]) at the batch's positions:
        [B * (P + R), ...], ``fill`` where no stream token runs."""
        out = values.new_full((len(self.places), *values.shape[1:]), fill)
        placed = self.places >= 0
        out[placed] = values[self.places[placed]]
        return out


def packed_layout(
    batch, device: torch.device, dtype: torch.dtype, causal: bool | None = None
) -> PackedLayout:
    """The flat layout of ``batch`` (a ``TrainBatch``); rows with identical prompt tokens share
    one copy of the prompt. ``causal``: a block per row (``PackedLayout.causal``) or the
    shared blocks; by default whichever scores fewer query-key pairs."""
    stream = _Stream.of(batch)
    if causal is None:
        causal = _rows_score_less(stream)
    if causal:
        return _causal_layout(stream, device, dtype)
    prompt_index, prompt_real = _padded(stream.prompt_starts, stream.prompt_lens)  # [U, Pm]
    response_index, response_real = _padded(stream.response_starts, stream.response_lens)
    group = torch.tensor(stream.group)  # [B] each row's distinct prompt
    units = len(stream.prompt_lens)
    prompt_width, response_width = prompt_index.shape[1], response_index.shape[1]
    queries = max(prompt_width, response_width)
    query_index = torch.cat(
        [
            F.pad(prompt_index, (0, queries - prompt_width)),
            F.pad(response_index, (0, queries - response_width)),
        ]
    )  # [U + B, Q]
    query_real = torch.cat(
        [
            F.pad(prompt_real, (0, queries - prompt_width)),
            F.pad(response_real, (0, queries - response_width)),
        ]
    )
    key_index = torch.cat(
        [
            torch.cat([prompt_index, prompt_index.new_zeros(units, response_width)], 1),
            torch.cat([prompt_index[group], response_index], 1),
        ]
    )  # [U + B, Pm + Rm]: key j is a prompt token (j < Pm) or the response input j - Pm
    causal = torch.ones(queries, queries, dtype=torch.bool).tril()
    sees_prompt = torch.cat(  # prompt token j sees prompt tokens <= j
        [
            causal[:, :prompt_width][None] & prompt_real[:, None, :],
            torch.zeros(units, queries, response_width, dtype=torch.bool),
        ],
        -1,
    )
    sees_response = torch.cat(  # response input i sees its prompt and response inputs <= i
        [
            prompt_real[group][:, None, :].expand(-1, queries, -1),
            causal[:, :response_width][None] & response_real[:, None, :],
        ],
        -1,
    )
    sees = torch.cat([sees_prompt, sees_response])  # [U + B, Q, Pm + Rm]
    sees[..., 0] |= ~query_real  # a padding query reads key 0: no empty softmax
    return PackedLayout(
        query_slots=query_index.to(device),
        key_slots=key_index.to(device),
        sees=sees[:, None].to(device),
        dtype=dtype,
        unpad=query_real.flatten().nonzero().squeeze(1).to(device),
        **stream.tensors(device),
    )


def _rows_score_less(stream: _Stream) -> bool:
    """Whether a block per row (``PackedLayout.causal``) scores no more query-key pairs than
    the shared blocks: always where no two rows share a prompt; where they do, when the
    answers are long against the prompt (for one group of B rows, about B times as long), or
    the prompts long against the answers, since the shared blocks pad every block's queries
    to the longest prompt or answer and keep a mask over them; a row of a group then runs
    its prompt's queries again in attention. ``benchmarks/packed_layouts.py``, ~47M model:
    4 answers of 2,048 tokens to a 128-token prompt 0.79x the time and 0.96x the saved bytes
    of the shared blocks; 2 x 8 answers of 32-64 tokens to 1,024-token prompts 0.74x / 0.93x;
    8 x 8 answers of 16-128 tokens to 100-token prompts stay shared (a block per row there:
    1.05x / 1.08x)."""
    rows = len(stream.group)
    if len(stream.prompt_lens) == rows:
        return True
    lengths = zip(stream.group, stream.response_lens, strict=True)
    width = max(stream.prompt_lens[unit] + length for unit, length in lengths)
    prompt, response = max(stream.prompt_lens), max(stream.response_lens)
    shared = (len(stream.prompt_lens) + rows) * max(prompt, response) * (prompt + response)
    return rows * width**2 <= shared


def _causal_layout(stream: _Stream, device: torch.device, dtype: torch.dtype) -> PackedLayout:
    """A block per row: row b's is its prompt then its response inputs, padded at the end
    (``PackedLayout.causal``)."""
    rows = []
    for row, unit in enumerate(stream.group):
        prompt, response = stream.prompt_starts[unit], stream.response_starts[row]
        rows.append(
            [
                *range(prompt, prompt + stream.prompt_lens[unit]),
                *range(response, response + stream.response_lens[row]),
            ]
        )
    width = max(map(len, rows), default=0)
    index = torch.tensor([row + [0] * (width - len(row)) for row in rows], dtype=torch.long)
    real = torch.arange(width)[None, :] < torch.tensor([len(row) for row in rows])[:, None]
    # Each flat token's block slot: a shared prompt's first row's (rows compute it alike).
    unpad = torch.full((len(stream.ids),), index.numel(), dtype=torch.long)
    unpad.scatter_reduce_(0, index[real], real.flatten().nonzero().squeeze(1), "amin")
    return PackedLayout(
        query_slots=index.to(device),
        key_slots=index.to(device),
        sees=None,
        dtype=dtype,
        unpad=unpad.to(device),
        causal=True,
        **stream.tensors(device),
    )


def layout_of(model: nn.Module, batch) -> PackedLayout:
    """The packed layout of ``batch`` for ``model``'s device and dtype (made once per batch)."""
    weight = unwrap(model).model.embed_tokens.weight
    key = (weight.device, weight.dtype)
    return batch.layouts.get(key) or batch.layouts.setdefault(key, packed_layout(batch, *key))


@dataclass
class _Stream:
    """The flat token stream of a batch, as host lists: ids and positions, where each distinct
    prompt and each row's response inputs start and how long they are, each row's prompt
    number, and the predictor of each real response token."""

    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    prompt_starts: list[int] = field(default_factory=list)
    prompt_lens: list[int] = field(default_factory=list)
    response_starts: list[int] = field(default_factory=list)
    response_lens: list[int] = field(default_factory=list)
    group: list[int] = field(default_factory=list)
    predictors: list[int] = field(default_factory=list)
    sources: list[int] = field(default_factory=list)
    places: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, batch) -> _Stream:
        width = batch.prompt_width
        rows = batch.input_ids.tolist()
        prompt_mask = batch.attention_mask[:, :width].tolist()
        lengths = batch.response_real.sum(-1).long().tolist()
        stream, prompts, first = cls(), {}, {}
        for number, (row, real) in enumerate(zip(rows, prompt_mask, strict=True)):
            tokens = tuple(t for t, keep in zip(row[:width], real, strict=True) if keep)
            unit = prompts.setdefault(tokens, len(prompts))
            first.setdefault(unit, number)
            stream.group.append(unit)
        columns = len(rows[0]) if rows else 0
        stream.places = [-1] * (len(rows) * columns)
        for unit, tokens in enumerate(prompts):
            stream.prompt_starts.append(len(stream.ids))
            stream.prompt_lens.append(len(tokens))
            stream.ids += tokens
            stream.positions += range(len(tokens))
            origin = first[unit] * columns + width - len(tokens)
            stream.sources += range(origin, origin + len(tokens))
        for number, (row, unit, length) in enumerate(zip(rows, stream.group, lengths, strict=True)):
            inputs = row[width : width + max(length - 1, 0)]  # the last token predicts nothing
            start, prompt_len = len(stream.ids), stream.prompt_lens[unit]
            stream.response_starts.append(start)
            stream.response_lens.append(len(inputs))
            stream.ids += inputs
            stream.positions += range(prompt_len, prompt_len + len(inputs))
            at = number * columns + width
            stream.sources += range(at, at + len(inputs))
            stream.places[at : at + len(inputs)] = range(start, start + len(inputs))
            prompt_at, prompt_start = at - prompt_len, stream.prompt_starts[unit]
            stream.places[prompt_at:at] = range(prompt_start, prompt_start + prompt_len)
            if length > 0:  # the prompt's last token predicts the first response token
                last = stream.prompt_starts[unit] + prompt_len - 1
                stream.predictors += [last, *range(start, start + len(inputs))]
        return stream

    def tensors(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The per-token lists every layout of the stream holds, as tensors on ``device``."""
        names = ("ids", "positions", "predictors", "sources", "places")
        return {
            name: torch.tensor(getattr(self, name), dtype=torch.long, device=device)
            for name in names
        }


def _padded(starts: list[int], lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs of flat indices ``start, start + 1, ...`` -> [len(starts), longest] and the mask of
    real entries. Padding entries point at index 0: a padding key is masked out and a padding
    query's output is dropped, so what they read never counts (and their gradient is 0)."""
    lengths_t = torch.tensor(lengths, dtype=torch.long)
    offsets = torch.arange(max(lengths, default=0), dtype=torch.long)
    real = offsets[None, :] < lengths_t[:, None]
    index = torch.tensor(starts, dtype=torch.long)[:, None] + offsets[None, :]
    return index.masked_fill_(~real, 0), real


def packed_response_logprobs(
    model: nn.Module,
    batch,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    chunk_tokens: int = 512,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``response_logprobs`` through the packed forward: [B, R] logprobs (and entropy), 0 at
    padding. ``model`` must pass ``packed_supported``."""
    layout = layout_of(model, batch)
    model = unwrap(model)
    x = packed_hidden(model, layout.ids, layout.positions, layout)
    hidden = rms_norm(x.index_select(0, layout.predictors), norm_of(model.model.norm))  # [T, E]
    real = batch.response_real.bool()  # every response token: tool responses are masked later
    logprobs, entropy = head_logprobs(
        hidden,
        model.lm_head.weight,
        batch.responses[real],
        temperature=temperature,
        with_entropy=with_entropy,
        entropy_grad=entropy_grad,
        chunk_tokens=chunk_tokens,
    )
    zeros = torch.zeros(real.shape, dtype=logprobs.dtype, device=logprobs.device)
    logprobs = zeros.masked_scatter(real, logprobs)
    return logprobs, None if entropy is None else zeros.masked_scatter(real, entropy)


def packed_hidden(model: nn.Module, ids, positions, layout: PackedLayout, attend=None):
    """The last block's output [n, E] (before the final norm) for stream tokens ``ids`` at
    ``positions`` [n]: all of ``layout``'s, or a slice of them with an ``attend`` that sees the
    whole stream (sequence parallelism). ``attend(q, k, v, layout, scaling)`` is the attention
    step, q [n, H, D] and k/v [n, Hkv, D] -> [n, H*D]; by default ``packed_attention``."""
    inner = unwrap(model).model
    embed = inner.embed_tokens  # as nn.Embedding: no gradient reaches the padding row
    x = F.embedding(ids, embed.weight, padding_idx=embed.padding_idx)  # [n, E]
    cos, sin = rotary(inner.rotary_emb.inv_freq, positions, x.dtype)  # [n, D]
    cos, sin = cos[:, None], sin[:, None]  # [n, 1, D]: broadcast over heads
    attend = attend or packed_attention
    for layer in inner.layers:
        h = rms_norm(x, norm_of(layer.input_layernorm))
        x = x + _attention(layer, h, cos, sin, layout, attend)
        h = rms_norm(x, norm_of(layer.post_attention_layernorm))
        mlp = layer.mlp
        if is_moe_block(mlp):  # the model's own block: router, experts, shared experts
            x = x + moe_forward(mlp, h)
            continue
        gate, up = project(h, projection(mlp.gate_proj, mlp.up_proj)).chunk(2, -1)
        x = x + mlp.down_proj(F.silu(gate) * up)
    return x


def _attention(layer, h, cos, sin, layout: PackedLayout, attend) -> torch.Tensor:
    """One block's self-attention output (after o_proj) for the flat tokens ``h`` [N, E]."""
    attn = layer.self_attn
    dim = attn.head_dim
    qkv = project(h, projection(attn.q_proj, attn.k_proj, attn.v_proj))
    qkv = qkv.view(h.shape[0], -1, dim)  # [N, H + 2 Hkv, D]
    heads, kv_heads = attn.q_proj.out_features // dim, attn.k_proj.out_features // dim
    qkv = norm_heads(qkv, heads, kv_heads, head_norms(attn))
    qk = rotate(qkv[:, : heads + kv_heads], cos, sin)  # q and k rotated together
    q, k, v = qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads :]
    return attn.o_proj(attend(q, k, v, layout, attn.scaling))  # [N, E]


def packed_attention(q, k, v, layout: PackedLayout, scaling: float) -> torch.Tensor:
    """The whole stream's attention: q [N, H, D], k/v [N, Hkv, D] -> [N, H*D]."""
    out = _block(
        _gather(q, layout.query_slots),
        _gather(k, layout.key_slots),
        _gather(v, layout.key_slots),
        layout,
        scaling,
    )  # [U + B, Q, H*D]
    return out.flatten(0, 1).index_select(0, layout.unpad)  # [N, H*D]


def _gather(x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows ``slots`` [n, S] of ``x`` [N, heads, D] -> [n, S, heads, D] (``index_select``:
    its backward adds the gradients of repeated slots, as a shared prompt needs)."""
    return x.index_select(0, slots.reshape(-1)).view(*slots.shape, *x.shape[1:])


# Above this many bytes of attention scores per layer (the peer benchmark's 16-token batch
# has 0.4 MiB, 128-token responses ~20 MiB), attention goes through
# scaled_dot_product_attention, which does not keep the [.., T, S] probabilities for the
# backward pass (long responses); below it, two matmuls and a softmax are faster on CPU.
MATH_ATTENTION_BYTES = 4 << 20


def _block(q, k, v, layout: PackedLayout, scaling: float) -> torch.Tensor:
    """Grouped-query attention of padded blocks: q [n, T, H, D], k/v [n, S, Hkv, D] -> [n, T, H*D].

    As HF's attention: query head h reads KV head h // (H / Hkv); scores scaled, masked,
    softmax in float32, cast back, times the values."""
    n, queries, heads, dim = q.shape
    keys, kv_heads = k.shape[1], k.shape[2]
    if n * heads * queries * keys * 4 > MATH_ATTENTION_BYTES:
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            # [n, 1, T, S], additive, made once: a boolean mask would be turned into a float
            # one by every layer's call, and each kept for its backward pass
            attn_mask=None if layout.causal else layout.additive()[:, :, 0],
            is_causal=layout.causal,
            scale=scaling,
            enable_gqa=heads != kv_heads,
        )  # [n, H, T, D]
        return out.transpose(1, 2).reshape(n, queries, heads * dim)
    group = heads // kv_heads
    q = q.view(n, queries, kv_heads, group, dim).permute(0, 2, 3, 1, 4)  # [n, Hkv, G, T, D]
    q = q.reshape(n, kv_heads, group * queries, dim)
    scores = torch.matmul(q, k.permute(0, 2, 3, 1)) * scaling  # [n, Hkv, G*T, S]
    scores = scores.view(n, kv_heads, group, queries, keys) + layout.additive()
    probs = scores.softmax(-1, dtype=torch.float32).to(v.dtype).view(n, kv_heads, -1, keys)
    out = torch.matmul(probs, v.transpose(1, 2)).view(n, kv_heads, group, queries, dim)
    return out.permute(0, 3, 1, 2, 4).reshape(n, queries, heads * dim)
