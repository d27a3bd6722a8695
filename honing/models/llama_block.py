"""The Llama-family decoder block's arithmetic, shared by the lean forwards.

Two lean paths skip the Hugging Face module forward for the same maths with less overhead:
``honing.rollout.native.fast_decode`` (prefill and one-token steps with a KV cache) and
``honing.trainer.packed`` (the logprob passes of training, prompts shared by their group and
no padding). Both compute exactly what the HF forward computes, operation for operation, so
they must agree on which models qualify (``supports``) and on the three pieces of the block
that HF spells in its own way: RMSNorm in float32, the rotary tables and ``rotate_half``.
They also share how projections reading one input are run (``projection`` / ``project``):
stacked into one matmul while small, on their own weights when big.

What qualifies: the transformers ``LlamaForCausalLM``, ``Qwen2ForCausalLM``,
``MistralForCausalLM`` and ``Qwen3ForCausalLM`` classes and the mixture-of-experts
``Qwen3MoeForCausalLM``, ``Qwen2MoeForCausalLM`` and ``MixtralForCausalLM`` (not
``trust_remote_code`` ones) whose blocks are exactly RMSNorm -> GQA attention (plain
``nn.Linear`` q/k/v/o with or without bias, Qwen3's per-head RMSNorm of q and k) with the
default rotary embedding -> RMSNorm -> a SiLU-gated MLP or a top-k routed MoE block, in
float32, bfloat16 or float16, with no sliding window and no rope scaling. An MoE block runs
as the model's own module (its router, then its experts as grouped matrix products, shared
experts included), so its routers' hooks (``honing.models.moe``) see the lean paths too.
Quantised layers are not ``nn.Linear`` and so fall back; so do OLMoE (q/k norms over all
heads) and DeepSeek-V3 (multi-head latent attention).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

# transformers class name -> model_type; each shares the Llama decoder block (the MoE ones
# with routed experts in place of its MLP).
SUPPORTED_CLASSES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "MixtralForCausalLM": "mixtral",
}
# Attention children beyond q/k/v/o a block may have: Qwen3's per-head norms of q and k.
HEAD_NORMS = {"q_norm", "k_norm"}
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def unwrap(model: nn.Module) -> nn.Module:
    """The transformers model inside a PEFT (LoRA) wrapper, or ``model`` itself."""
    if hasattr(model, "peft_config") and hasattr(model, "get_base_model"):
        return model.get_base_model()
    return model


def is_moe_block(module: nn.Module) -> bool:
    """Whether ``module`` (a decoder layer's ``mlp``) is a top-k routed MoE block: a router
    ``gate`` with a ``top_k`` and an ``experts`` module (``honing.models.moe``)."""
    gate, experts = getattr(module, "gate", None), getattr(module, "experts", None)
    return (
        isinstance(gate, nn.Module)
        and isinstance(experts, nn.Module)
        and isinstance(getattr(gate, "top_k", None), int)
    )


def _plain_or_lora(linear: nn.Module) -> bool:
    """An ``nn.Linear``, or PEFT's LoRA layer around one (no DoRA)."""
    if type(linear) is nn.Linear:
        return True
    base = getattr(linear, "base_layer", None)
    return (
        type(linear).__module__.startswith("peft.tuners.lora")
        and type(base) is nn.Linear
        and not any(getattr(linear, "use_dora", {}).values())
    )


def supports(model: nn.Module) -> bool | str:
    """True when ``model`` (or the model in its LoRA wrapper) is a Llama-family block stack
    the lean forwards compute exactly, else the reason it is not."""
    model = unwrap(model)
    name, config = type(model).__name__, model.config
    if not type(model).__module__.startswith("transformers.models."):
        return f"{type(model).__module__}.{name} is not a transformers class"
    if SUPPORTED_CLASSES.get(name) != getattr(config, "model_type", None):
        return f"{name} (model_type {getattr(config, 'model_type', None)}) is not Llama-family"
    if config.hidden_act != "silu":
        return f"hidden_act {config.hidden_act!r} is not silu"
    rotary = model.model.rotary_emb
    if rotary.rope_type != "default" or rotary.attention_scaling != 1.0:
        return f"rope type {rotary.rope_type!r} is not the default"
    if getattr(config, "sliding_window", None) or "sliding_attention" in (
        getattr(config, "layer_types", None) or ()
    ):
        return f"sliding window attention ({config.sliding_window})"
    dtype = model.model.embed_tokens.weight.dtype
    if dtype not in SUPPORTED_DTYPES:
        return f"dtype {dtype} is not one of {SUPPORTED_DTYPES}"
    if type(model.model.embed_tokens) is not nn.Embedding or type(model.lm_head) is not nn.Linear:
        return "the embedding or lm_head is not a plain module"
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj]
        if not is_moe_block(mlp):
            gated = [getattr(mlp, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
            if None in gated:  # e.g. an MoE block whose router a wrapper hides
                return f"{type(mlp).__name__} is neither a gated MLP nor a top-k routed MoE block"
            linears += gated
        if not all(_plain_or_lora(linear) for linear in linears):
            return "a projection is not nn.Linear or a LoRA layer on one (quantised?)"
        extra = set(dict(attn.named_children())) - {"q_proj", "k_proj", "v_proj", "o_proj"}
        if (
            set(dict(layer.named_children()))
            != {
                "self_attn",
                "mlp",
                "input_layernorm",
                "post_attention_layernorm",
            }
            or extra - HEAD_NORMS
        ):
            return "a decoder layer has modules beyond the Llama block"
        if extra and (extra != HEAD_NORMS or attn.q_norm.weight.shape[-1] != attn.head_dim):
            return "q/k norms that are not per head"
    return True


def head_norms(attn: nn.Module) -> tuple[Norm, Norm] | None:
    """Qwen3's per-head RMSNorms of the queries and keys, or None (Llama)."""
    if not hasattr(attn, "q_norm"):
        return None
    return norm_of(attn.q_norm), norm_of(attn.k_norm)


def norm_heads(qkv: torch.Tensor, heads: int, kv_heads: int, norms) -> torch.Tensor:
    """``qkv`` [..., H + 2 Hkv, D] with the query heads and the key heads normed by ``norms``
    (``head_norms``; None: as it is)."""
    if norms is None:
        return qkv
    q, k, v = qkv.split([heads, kv_heads, qkv.shape[-2] - heads - kv_heads], dim=-2)
    return torch.cat([rms_norm(q, norms[0]), rms_norm(k, norms[1]), v], dim=-2)


def moe_forward(block: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """An MoE block (the model's own module) on hidden states ``h`` [..., E] of any shape
    (the blocks take [B, T, E])."""
    return block(h.reshape(1, -1, h.shape[-1])).view(h.shape)


def adapted_weight(layer: nn.Module) -> torch.Tensor:
    """A PEFT LoRA layer's weight with its active adapters merged in (PEFT's own delta, for
    linear and embedding layers; a differentiable copy, the layer is not changed). Adapters
    PEFT merged into the base weight already are in it."""
    weight = layer.base_layer.weight
    if not layer.disable_adapters and not layer.merged:
        for name in layer.active_adapters:
            if name in layer.scaling:  # lora_A (linear) or lora_embedding_A
                weight = weight + layer.get_delta_weight(name).to(weight.dtype)
    return weight


def linear_params(linear: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Weight and bias; a LoRA layer's active adapters are merged into the weight (a copy: the
    same output as PEFT's forward up to floating-point reassociation)."""
    if type(linear) is nn.Linear:
        return linear.weight, linear.bias
    return adapted_weight(linear), linear.base_layer.bias


def fused_linear(*linears: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The linears' weights stacked along the output dimension (a copy, made per call so that
    weight updates are seen; differentiable); their outputs are the slices of the fused one's."""
    params = [linear_params(linear) for linear in linears]
    weight = torch.cat([w for w, _ in params])
    if all(b is None for _, b in params):
        return weight, None
    bias = [b if b is not None else w.new_zeros(w.shape[0]) for w, b in params]
    return weight, torch.cat(bias)


# Up to this many bytes of weights, linears that read the same input (q/k/v, gate/up) run as
# one matmul over a stacked copy of their weights (LoRA merged in): on CPU-sized models the
# number of operations is the cost. Above it each runs on its own weights, by its own forward:
# copies of big weights would cost memory (for a 7B model, ~60% of its weights for the
# stacks, all of them for LoRA merges; in training the copies are kept for the backward).
FUSE_BYTES = 4 << 20

# A projection: (weight, bias) to multiply by, or the modules to call, in output order.
Projection = tuple[torch.Tensor, torch.Tensor | None] | tuple[nn.Module, ...]


def projection(*linears: nn.Module) -> Projection:
    """``linears`` (reading one input) made ready for ``project``: one plain ``nn.Linear`` is
    its own weight (no copy); small ones are stacked (``fused_linear``); big ones stay
    modules."""
    if len(linears) == 1 and type(linears[0]) is nn.Linear:
        return linear_params(linears[0])
    weights = [getattr(linear, "base_layer", linear).weight for linear in linears]
    if sum(w.numel() * w.element_size() for w in weights) <= FUSE_BYTES:
        return fused_linear(*linears)
    return linears


def project(h: torch.Tensor, projection: Projection) -> torch.Tensor:
    """``h`` through a ``projection``: the outputs side by side [..., sum of outputs]."""
    if isinstance(projection[0], torch.Tensor):
        return F.linear(h, *projection)
    if len(projection) == 1:
        return projection[0](h)
    return torch.cat([module(h) for module in projection], -1)


class Norm(NamedTuple):
    weight: torch.Tensor
    eps: float


def norm_of(module: nn.Module) -> Norm:
    return Norm(module.weight, module.variance_epsilon)


def rms_norm(x: torch.Tensor, norm: Norm) -> torch.Tensor:
    """HF LlamaRMSNorm: normalise in float32, cast back, then scale (one fused op in float32)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, x.shape[-1:], norm.weight, norm.eps)
    return norm.weight * F.rms_norm(x.float(), x.shape[-1:], eps=norm.eps).to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """HF ``x * cos + rotate_half(x) * sin``, where ``rotate_half(x) = cat(-x2, x1)``: the same
    products as ``cat(x2, x1) * cat(-sin1, sin2)`` (a negation is exact), one op fewer."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def rotary(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of ``positions`` [...] as HF's rotary embedding makes them (float32, then
    ``dtype``), the first half of sin negated for ``rotate``: two [..., D] tensors."""
    freqs = positions[..., None].float() * inv_freq.float()  # [..., D/2]
    cos = torch.cat((freqs, freqs), dim=-1).cos().to(dtype)
    sin = freqs.sin().to(dtype)
    return cos, torch.cat((-sin, sin), dim=-1)
