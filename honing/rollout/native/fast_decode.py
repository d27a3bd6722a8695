"""A lean inference forward for Llama-family causal LMs: prefill and one-token decode steps.

Why: at the sizes RL fine-tuning runs on a small machine, a decode step of the Hugging Face
forward spends most of its time in Python (mask creation, rotary helpers, cache bookkeeping,
output wrappers), not in the matrix products. This module runs the same arithmetic with a
pre-allocated KV cache, one boolean mask, q/k/v and gate/up projections fused into one matmul
each, ``scaled_dot_product_attention`` for the prompt and two batched matmuls for each new
token's attention (the fused CPU kernel is slower for a single query), and nothing else.

What is supported: ``honing.models.llama_block.supports`` says (Llama-family blocks in
float32/bfloat16/float16; small LoRA layers are merged per generation, big ones run by PEFT's
own forward; anything else falls back).

Why it is exact: every operation is the one the Hugging Face modules run, in the same order and
dtype: RMSNorm in float32 cast back before the weight, cos/sin computed in float32 from the
model's own ``inv_freq`` buffer and cast to the model dtype, ``rotate_half`` rotary, attention
with scale ``head_dim ** -0.5`` over the same keys (left padding masked out), the SiLU-gated
MLP. The weights are read from the module at each ``prefill`` (q/k/v and gate/up stacked
into one matrix each, a copy, while under ``llama_block.FUSE_BYTES``; bigger ones and the
others used as they are), so a weight update by the trainer is seen by the next generation.
Results differ from the HF forward only by floating-point reassociation inside kernels (~1e-7
in float32).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from honing.models.llama_block import (
    Norm,
    Projection,
    head_norms,
    is_moe_block,
    linear_params,
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

__all__ = ["FastDecoder", "supports", "unwrap"]


class _Layer(NamedTuple):
    """One decoder block's projections for one generation (``llama_block.projection``):
    q/k/v and gate/up stacked into one matrix each while small (one matmul instead of three
    and two), big ones run by their modules."""

    input_norm: Norm
    qkv: Projection
    qkv_sizes: tuple[int, int, int]
    o: Projection
    post_norm: Norm
    gate_up: Projection | None  # None: an MoE block (``moe``)
    down: Projection | None
    head_norms: tuple[Norm, Norm] | None  # Qwen3's per-head q and k norms
    moe: nn.Module | None  # the model's own MoE block


def _layer(layer: nn.Module) -> _Layer:
    attn, mlp = layer.self_attn, layer.mlp
    moe = mlp if is_moe_block(mlp) else None
    return _Layer(
        norm_of(layer.input_layernorm),
        projection(attn.q_proj, attn.k_proj, attn.v_proj),
        (attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features),
        projection(attn.o_proj),
        norm_of(layer.post_attention_layernorm),
        None if moe else projection(mlp.gate_proj, mlp.up_proj),
        None if moe else projection(mlp.down_proj),
        head_norms(attn),
        moe,
    )


def _mlp(x: torch.Tensor, layer: _Layer) -> torch.Tensor:
    """``x`` plus the block's MLP (or MoE block) of its post-attention norm."""
    h = rms_norm(x, layer.post_norm)
    if layer.moe is not None:
        return x + moe_forward(layer.moe, h)
    gate, up = project(h, layer.gate_up).chunk(2, dim=-1)
    if x.dim() == 2:  # a decode step's [B, E] rows: the residual inside the addmm
        return _residual(x, F.silu(gate) * up, layer.down)
    return x + project(F.silu(gate) * up, layer.down)


def _first(rows: torch.Tensor) -> torch.Tensor:
    """For ``rows`` (each row's distinct-prompt number, 0..U-1), the first row of each."""
    first = torch.full((int(rows.max()) + 1,), len(rows), dtype=torch.long, device=rows.device)
    return first.scatter_reduce(0, rows, torch.arange(len(rows), device=rows.device), "amin")


def _residual(x: torch.Tensor, h: torch.Tensor, linear: Projection) -> torch.Tensor:
    """``x + linear(h)``, as one ``addmm`` for a weight without bias ([B, E] rows)."""
    weight, bias = linear[0], linear[-1]
    if isinstance(weight, torch.Tensor) and bias is None:
        return torch.addmm(x, h, weight.t())
    return x + project(h, linear)


class FastDecoder:
    """Prefill then one-token decode steps of a supported model, with a pre-allocated KV cache.

    Usage: ``logits = decoder.prefill(ids, mask, positions, max_new_tokens)`` then, per new
    token, ``logits = decoder.step(token, positions)``; both return the last position's logits
    ``[B, V]`` in the model dtype. Call under ``torch.no_grad()`` with the model in eval mode.
    ``hidden`` holds the final (normed) hidden states the last call's logits came from;
    ``prefill_rows``, for each row, the row of the prefill that ran its prompt (rows with the
    same prompt share one), or None when each ran its own.
    """

    def __init__(self, model: nn.Module):
        reason = supports(model)
        if reason is not True:
            raise ValueError(f"fast decoding does not apply: {reason}")
        self.model = model = unwrap(model)
        attn = model.model.layers[0].self_attn
        self.head_dim, self.scaling = attn.head_dim, attn.scaling
        self.heads = model.config.num_attention_heads
        self.kv_heads = model.config.num_key_value_heads

    def prefill(
        self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, max_new_tokens: int
    ) -> torch.Tensor:
        """Run the left-padded prompts ``ids`` [B, P] (``mask`` 1 on real tokens, ``positions``
        counting from each row's first real token) and make room for ``max_new_tokens`` more.

        Rows with the same prompt (a group's samples) are run once and their cache copied:
        the same keys and values, as the forward of a row depends on that row alone."""
        weight = self._read_weights(positions, max_new_tokens)
        batch, prompt_len = ids.shape
        capacity = prompt_len + max_new_tokens
        shape = (len(self.layers), batch, self.kv_heads, capacity, self.head_dim)
        self.valid = torch.ones(batch, capacity, dtype=torch.bool, device=weight.device)  # [B, S]
        self.valid[:, :prompt_len] = mask.bool()
        self.length = 0
        distinct, rows = torch.unique(torch.cat([ids, mask], 1), dim=0, return_inverse=True)
        if len(distinct) == batch:
            rows = None
        else:  # run each distinct prompt once, then give every row its prompt's cache
            first = _first(rows)
            ids, mask, positions = ids[first], mask[first], positions[first]
        self.prefill_rows = rows  # each row's run row in the prefill (None: one each)
        run = len(ids)
        width = capacity if rows is None else prompt_len  # shared: a prompt-only cache
        self.keys = weight.new_empty((shape[0], run, shape[2], width, shape[4]))
        self.values = torch.empty_like(self.keys)
        # A query sees earlier real keys; a padding query also sees itself, so that no row of
        # the softmax is empty (its output is never used, but NaN would reach the cache).
        causal = torch.ones(prompt_len, prompt_len, dtype=torch.bool, device=ids.device).tril()
        eye = torch.eye(prompt_len, dtype=torch.bool, device=ids.device)
        attend = (causal & mask.bool()[:, None, None, :]) | eye  # [B, 1, P, P]
        logits = self._forward(ids, positions, attend)
        if rows is not None:
            keys, values = self.keys, self.values
            self.keys, self.values = weight.new_empty(shape), weight.new_empty(shape)
            self.keys[:, :, :, :prompt_len] = keys[:, :, :, :prompt_len][:, rows]
            self.values[:, :, :, :prompt_len] = values[:, :, :, :prompt_len][:, rows]
            logits, self.hidden = logits[rows], self.hidden[rows]
        self.decoded_from = self.length
        return logits

    def resume(
        self,
        kept: list[tuple[torch.Tensor, torch.Tensor] | None],
        ids: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        max_new_tokens: int,
    ) -> torch.Tensor:
        """``prefill`` after a cache kept from earlier calls: row i's keys and values
        ``kept[i]`` ([L, Hkv, n_i, D] each, as ``kept_cache`` gave them; None for a row that
        starts afresh) come first, as they are (whatever weights made them), then its
        left-padded ``ids`` [B, W] at ``positions`` [B, W] (n_i onwards). Returns the last
        position's logits [B, V]."""
        weight = self._read_weights(positions, max_new_tokens)
        batch, width = ids.shape
        held = max((k.shape[2] for k, _ in filter(None, kept)), default=0)
        capacity = held + width + max_new_tokens
        shape = (len(self.layers), batch, self.kv_heads, capacity, self.head_dim)
        self.keys, self.values = weight.new_zeros(shape), weight.new_zeros(shape)
        self.valid = torch.ones(batch, capacity, dtype=torch.bool, device=weight.device)
        self.valid[:, :held] = False
        for row, cache in enumerate(kept):
            if cache is not None:  # right-aligned against the new tokens
                count = cache[0].shape[2]
                self.keys[:, row, :, held - count : held] = cache[0]
                self.values[:, row, :, held - count : held] = cache[1]
                self.valid[row, held - count : held] = True
        self.valid[:, held : held + width] = mask.bool()
        self.length, self.prefill_rows = held, None
        end = held + width
        attend = self.valid[:, None, None, :end].expand(-1, 1, width, end).clone()
        block = torch.ones(width, width, dtype=torch.bool, device=ids.device).tril()
        attend[:, :, :, held:end] &= block
        attend[:, :, :, held:end] |= torch.eye(width, dtype=torch.bool, device=ids.device)
        logits = self._forward(ids, positions, attend)
        self.decoded_from = self.length
        return logits

    def kept_cache(self, row: int, stepped: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row ``row``'s keys and values [L, Hkv, n, D] (copies): its real tokens of the
        prefill or resume, then the first ``stepped`` tokens its decode steps fed."""
        slots = torch.cat(
            [
                self.valid[row, : self.decoded_from].nonzero()[:, 0],
                torch.arange(
                    self.decoded_from, self.decoded_from + stepped, device=self.valid.device
                ),
            ]
        )
        return self.keys[:, row][:, :, slots], self.values[:, row][:, :, slots]

    def _read_weights(self, positions: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Reads the model's weights for one generation and the cos / sin of every position
        a row can reach; returns the embedding (its dtype and device are the cache's)."""
        inner = self.model.model
        self.layers = [_layer(layer) for layer in inner.layers]  # read once per generation
        self.final_norm = norm_of(inner.norm)
        self.embedding = inner.embed_tokens.weight
        self.lm_head = linear_params(self.model.lm_head)
        weight = inner.embed_tokens.weight
        reach = torch.arange(int(positions.max()) + max_new_tokens + 1, device=weight.device)
        self.cos, self.sin = rotary(inner.rotary_emb.inv_freq, reach, weight.dtype)  # [S', D]
        return weight

    def step(self, token: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Append ``token`` [B] at ``positions`` [B, 1]; the logits of the next token [B, V].

        The single-token forward without the general path's reshapes: q and k rotated
        together, scores as one ``baddbmm`` (scaled, masked), residual additions inside the
        output projections' ``addmm``: the same products and sums, fewer operations."""
        slot = self.length
        end = slot + 1
        batch, heads, kv_heads, dim = token.shape[0], self.heads, self.kv_heads, self.head_dim
        x = F.embedding(token, self.embedding)  # [B, E]
        index = positions[:, 0]
        cos, sin = self.cos[index][:, None], self.sin[index][:, None]  # [B, 1, D]
        bias = torch.zeros(batch, kv_heads, 1, end, dtype=x.dtype, device=x.device)
        bias.masked_fill_(~self.valid[:, None, None, :end], float("-inf"))
        bias = bias.view(batch * kv_heads, 1, end)  # [B*Hkv, 1, S]
        for number, layer in enumerate(self.layers):
            qkv = project(rms_norm(x, layer.input_norm), layer.qkv).view(batch, -1, dim)
            qkv = norm_heads(qkv, heads, kv_heads, layer.head_norms)
            qk = rotate(qkv[:, : heads + kv_heads], cos, sin)  # [B, H + Hkv, D]
            self.keys[number, :, :, slot] = qk[:, heads:]
            self.values[number, :, :, slot] = qkv[:, heads + kv_heads :]
            keys = self.keys[number, :, :, :end].reshape(batch * kv_heads, end, dim)
            values = self.values[number, :, :, :end].reshape(batch * kv_heads, end, dim)
            query = qk[:, :heads].reshape(batch * kv_heads, heads // kv_heads, dim)
            scores = torch.baddbmm(bias, query, keys.transpose(1, 2), alpha=self.scaling)
            out = torch.bmm(scores.softmax(-1), values).view(batch, heads * dim)  # [B, H*D]
            x = _mlp(_residual(x, out, layer.o), layer)
        self.length = end
        last = rms_norm(x, self.final_norm)
        self.hidden = last[:, None]  # [B, 1, E]: what the logits came from
        return F.linear(last, *self.lm_head)  # [B, V]

    def extend(
        self, ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor
    ) -> torch.Tensor:
        """Append a block ``ids`` [B, W] at ``positions`` [B, W]; ``keep`` [B, W] says which of
        its slots later queries may see (a dropped slot is a hole: speculative decoding's
        rejected tokens and placeholders). Returns the logits of every position [B, W, V].
        Rows stay in lockstep (every row takes W slots), so ``prefill`` must have made room."""
        start, width = self.length, ids.shape[1]
        end = start + width
        self.valid[:, start:end] = keep.bool()
        seen = self.valid[:, None, None, :end].expand(-1, 1, width, end).clone()
        block = torch.ones(width, width, dtype=torch.bool, device=ids.device).tril()
        seen[:, :, :, start:end] &= block  # causal inside the block
        seen[:, :, :, start:end] |= torch.eye(width, dtype=torch.bool, device=ids.device)
        return self._forward(ids, positions, seen, every_position=True)

    def drop(self, start: int, slots: torch.Tensor) -> None:
        """Hide the cache slots ``start + j`` of each row where ``slots`` [B, W] is True."""
        self.valid[:, start : start + slots.shape[1]] &= ~slots

    def _forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        attend: torch.Tensor,
        every_position: bool = False,
    ) -> torch.Tensor:
        batch, width = ids.shape
        start, end = self.length, self.length + width
        x = F.embedding(ids, self.embedding)  # [B, T, E]
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]  # [B, 1, T, D]
        for index, layer in enumerate(self.layers):
            h = rms_norm(x, layer.input_norm)
            q, k, v = (
                part.view(batch, width, -1, self.head_dim)
                for part in project(h, layer.qkv).split(layer.qkv_sizes, dim=-1)
            )  # [B, T, H or Hkv, D]
            if layer.head_norms is not None:
                q, k = rms_norm(q, layer.head_norms[0]), rms_norm(k, layer.head_norms[1])
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            q = rotate(q, cos, sin)
            self.keys[index, :, :, start:end] = rotate(k, cos, sin)
            self.values[index, :, :, start:end] = v
            keys, values = self.keys[index, :, :, :end], self.values[index, :, :, :end]
            if width == 1:
                out = self._step_attention(q, keys, values, attend)
            else:
                out = F.scaled_dot_product_attention(
                    q,
                    keys,  # [B, Hkv, S, D]
                    values,
                    attn_mask=attend,
                    scale=self.scaling,
                    enable_gqa=self.heads != self.kv_heads,
                )  # [B, H, T, D]
            x = x + project(out.transpose(1, 2).reshape(batch, width, -1), layer.o)
            x = _mlp(x, layer)
        self.length = end
        if every_position:
            normed = rms_norm(x, self.final_norm)  # [B, T, E]
            self.hidden = normed
            return F.linear(normed, *self.lm_head)  # [B, T, V]
        last = rms_norm(x[:, -1], self.final_norm)  # the norm is per position: only the last
        self.hidden = last[:, None]  # [B, 1, E]: what the last position's logits came from
        return F.linear(last, *self.lm_head)  # [B, V]

    def _step_attention(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, attend: torch.Tensor
    ) -> torch.Tensor:
        """Attention of one new query per row, as two batched matmuls and a softmax: for a
        single query the fused CPU attention kernel costs several times more than this. The
        query heads sharing a KV head are grouped (HF's ``repeat_kv`` maps head h to KV head
        h // group), so no key is repeated. Returns [B, H, 1, D]."""
        batch, kv_heads, length, dim = keys.shape
        grouped = q.reshape(batch, kv_heads, -1, dim)  # [B, Hkv, G, D]
        scores = torch.matmul(grouped, keys.transpose(-1, -2)) * self.scaling  # [B, Hkv, G, S]
        scores = scores.masked_fill(~attend, float("-inf")).softmax(-1)
        return torch.matmul(scores, values).view(batch, -1, 1, dim)
