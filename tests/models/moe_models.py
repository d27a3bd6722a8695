"""Small random mixture-of-experts causal LMs of the five families honing names, built from
their transformers configs (no download): Qwen3-MoE (a dense layer among the MoE ones),
Qwen2-MoE (a gated shared expert), Mixtral, OLMoE and DeepSeek-V3 (group-limited sigmoid
routing, a shared expert, multi-head latent attention)."""

from __future__ import annotations

import torch
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3")

COMMON = {
    "hidden_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}


def moe_model(family: str, vocab: int, pad: int, *, seed: int = 0, **overrides):
    """A random ``family`` model in eval mode, norms and biases moved off their initial
    values so that they matter."""
    common = COMMON | {"vocab_size": vocab, "pad_token_id": pad}
    if family == "qwen3_moe":
        config = Qwen3MoeConfig(
            **common,
            head_dim=8,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            intermediate_size=40,
            mlp_only_layers=[1],
            norm_topk_prob=True,
        )
        cls = Qwen3MoeForCausalLM
    elif family == "qwen2_moe":
        config = Qwen2MoeConfig(
            **common,
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=40,
            intermediate_size=40,
        )
        cls = Qwen2MoeForCausalLM
    elif family == "mixtral":
        config = MixtralConfig(
            **common, num_local_experts=4, num_experts_per_tok=2, intermediate_size=24
        )
        cls = MixtralForCausalLM
    elif family == "olmoe":
        config = OlmoeConfig(**common, num_experts=8, num_experts_per_tok=2, intermediate_size=24)
        cls = OlmoeForCausalLM
    elif family == "deepseek_v3":
        config = DeepseekV3Config(
            **common | {"num_key_value_heads": 4},  # multi-head latent attention
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            n_shared_experts=1,
            moe_intermediate_size=16,
            intermediate_size=40,
            first_k_dense_replace=1,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            routed_scaling_factor=2.5,
        )
        cls = DeepseekV3ForCausalLM
    else:
        raise ValueError(family)
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "bias" in name or "norm" in name:
                param.add_(torch.randn_like(param) * 0.3)
            elif name.endswith("gate.weight") and param.dim() == 2:
                param.normal_(0, 0.5)  # routers far from uniform, so choices are clear
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0, 0.1)
    return model
