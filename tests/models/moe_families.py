"""Tiny random models of every top-k routed mixture-of-experts causal LM of the installed
transformers, built from their config classes (no download), so that a test meets each MoE
family honing may be given, the ones transformers adds later included.

Which families: a model type of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` whose class is a
``*ForCausalLM`` and whose modeling source mentions experts and a top-k (cheap), confirmed by
its tiny model having a module named ``experts`` (JetMoE's is its attention's mixture of
heads; its MLP's experts are ``input_linear`` / ``output_linear``). A family that fails to
build stays listed, so that the failure shows. A multimodal alias of a text model type, the
same class with a composite config, is left out for it: llama4 for llama4_text, and so
qwen3_5_moe, qwen4_exp, dots3_note. Model types that share a class under a config of their
own (param2moe and sarvam_moe: Glm4Moe; sarvam_mla: DeepseekV3) stay.

Doge has no ``experts`` module: its experts are rows of two embedding tables picked by
product-key retrieval (``router_gate``), with ``is_moe`` set (built so), which confirms it.

Sizes: hidden 64, 8 experts, top-2, vocabulary 128, two layers; a family with per-layer kinds
(attention, linear attention, Mamba, dense or sparse MLP) gets one layer of each kind, so the
hybrids have an attention layer and at least one MoE layer.
"""

from __future__ import annotations

import functools
import inspect
import re
import sys

import torch
import transformers
from torch import nn
from transformers import PreTrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

# Applied to every config that has the attribute; families name one thing differently.
SHRINK = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 96,  # and every other MLP width 48 (config_of)
    "moe_intermediate_size": 32,
    "vocab_size": 128,
    "unpadded_vocab_size": 128,
    "max_position_embeddings": 128,
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 8),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "moe_k"), 2),
    "n_shared_experts": 1,
    "first_k_dense_replace": 0,
    "mlp_only_layers": [],
    "n_group": 2,
    "topk_group": 1,
    # multi-head latent attention and the sparse-attention indexers (DeepSeek-V3.2 and kin)
    **dict.fromkeys(("kv_lora_rank", "q_lora_rank", "o_lora_rank", "v_head_dim"), 16),
    **dict.fromkeys(("qk_rope_head_dim", "qk_nope_head_dim"), 8),
    **dict.fromkeys(("index_n_heads", "index_num_heads"), 4),
    "index_head_dim": 16,
    "index_topk": 4,
    # linear attention, Mamba-2 mixers (few heads, a small state, short chunks)
    **dict.fromkeys(("linear_key_head_dim", "linear_value_head_dim", "linear_head_dim"), 16),
    "linear_num_key_heads": 2,
    **dict.fromkeys(("linear_num_value_heads", "linear_num_heads"), 4),
    **dict.fromkeys(("mamba_n_heads", "mamba_num_heads"), 4),
    "mamba_head_dim": 32,
    **dict.fromkeys(("mamba_d_state", "ssm_state_size"), 16),
    "n_groups": 2,
    **dict.fromkeys(("mamba_chunk_size", "chunk_size"), 8),
    # the sliding-window layers' own sizes (Inkling), windows shorter than a test's sequence
    "swa_num_attention_heads": 4,
    "swa_num_key_value_heads": 2,
    "swa_head_dim": 16,
    **dict.fromkeys(("sliding_window", "sliding_window_size", "attention_chunk_size"), 4),
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}

OVERRIDES: dict[str, dict] = {
    # DbrxAttention reads rope_theta from attn_config and clamps with clip_qkv unchecked
    "dbrx": {
        "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        "ffn_config": {"ffn_hidden_size": 32, "moe_num_experts": 8, "moe_top_k": 2},
    },
    # the sliding-window layers' own attention sizes
    "dots3_note_text": {
        "swa_num_attention_heads": 4,
        "swa_num_key_value_heads": 4,
        "swa_q_lora_rank": 16,
        "swa_kv_lora_rank": 16,
        "swa_head_dim": 16,
        "swa_qk_nope_head_dim": 8,
        "swa_v_head_dim": 16,
    },
    # MoE off by default; the global layers' head size and the per-layer input embeddings
    "gemma4_text": {
        "enable_moe_block": True,
        "top_k_experts": 2,
        "global_head_dim": 32,
        "vocab_size_per_layer_input": 128,
        "hidden_size_per_layer_input": 16,
    },
    # all layers Mamba by default: one of each, the attention one MoE
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},
    # layer_types is derived: layer 0 Mamba with a dense MLP, layer 1 attention with MoE
    "jamba": {
        "attn_layer_period": 2,
        "attn_layer_offset": 1,
        "expert_layer_period": 2,
        "expert_layer_offset": 1,
    },
    # product-key experts (a square number of them) only with is_moe
    "doge": {"is_moe": True, "num_experts": 16, "num_experts_per_tok": 2},
    # layer 1 looped twice, so that its router runs twice per forward as in the model
    "inkling2_loop_text": {
        "loop_layer_index_start": 1,
        "loop_layer_index_end": 2,
        "loop_num_passes": 2,
        "n_layers_per_attn_res_block": 1,
    },
    # at most the query heads of one key head
    "kolibri1_1": {"index_num_heads": 2},
    # no default layer types; two dense layers by default
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    # 256 zero (identity) experts by default; a layer holds two attention sublayers
    "longcat_flash": {
        "num_layers": 1,
        "zero_expert_num": 2,
        "ffn_hidden_size": 96,
        "expert_ffn_hidden_size": 32,
    },
    # the query-sparse attention indexer has no defaults; a small hyper-connection rank
    "qwen4_exp_text": {
        "indexer_n_heads": 4,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 16,
        "indexer_budget": 4,
        "indexer_compress_ratio": 2,
        "hc_lowrank": 16,
    },
    # refuses any top-k but 1; a small router MLP
    "zaya": {"num_experts_per_tok": 1, "router_hidden_size": 16},
}

# model type -> why it cannot be built small (none of transformers 5.16 to 5.25)
UNBUILDABLE: dict[str, str] = {}

ROUTERS = {"gate", "router"}  # the names of the router modules


def _causal_lm_class(model_type: str) -> type | None:
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    return getattr(transformers, name, None) if name.endswith("ForCausalLM") else None


def _is_alias(model_type: str, model_class: type) -> bool:
    """True for a composite config whose text part is the class's own config class."""
    config_class = CONFIG_MAPPING[model_type]
    text = getattr(config_class, "sub_configs", {}).get("text_config")
    return text is not None and text is model_class.config_class


def _candidates() -> list[str]:
    """The causal-LM model types whose modeling source mentions experts and a top-k."""
    found = []
    for model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        model_class = _causal_lm_class(model_type)
        if model_class is None or _is_alias(model_type, model_class):
            continue
        source = inspect.getsource(sys.modules[model_class.__module__])
        if "experts" in source and re.search(r"top_?k", source):
            found.append(model_type)
    return found


def expert_modules(model: nn.Module) -> list[str]:
    """The dotted names of ``model``'s routed-expert modules."""
    return [name for name, _ in model.named_modules() if name.rsplit(".", 1)[-1] == "experts"]


@functools.cache
def moe_families() -> list[str]:
    """The top-k routed MoE causal-LM model types of the installed transformers (each
    candidate built once to confirm it: a few seconds)."""
    families = []
    for model_type in _candidates():
        try:
            model = build(model_type)
            confirmed = bool(expert_modules(model)) or getattr(model.config, "is_moe", False)
        except Exception:
            confirmed = True  # listed so that the test shows why it does not build
        if confirmed:
            families.append(model_type)
    return families


def _present(config: PreTrainedConfig, key: str) -> bool:
    try:
        getattr(config, key)
    except AttributeError:
        return False
    except Exception:  # a per-layer attribute that may vary across layers
        return True
    return True


def _per_layer_kinds(default: PreTrainedConfig, kwargs: dict) -> None:
    """Every per-layer list of kinds (``layer_types``, ``mlp_layer_types``...) shrunk to one
    layer of each kind, in order of first appearance; as many layers as the most kinds."""
    layers = getattr(default, "num_hidden_layers", None)
    lists = {
        key: list(dict.fromkeys(value))
        for key, value in vars(default).items()
        if key.endswith(("layer_types", "layers_block_type"))
        and key not in kwargs
        and isinstance(value, list)
        and len(value) == layers
    }
    if not lists:
        return
    count = max([kwargs.get("num_hidden_layers", 2)] + [len(kinds) for kinds in lists.values()])
    kwargs["num_hidden_layers"] = count
    for key, kinds in lists.items():
        kwargs[key] = [kinds[i % len(kinds)] for i in range(count)]


def config_of(model_type: str, **overrides) -> PreTrainedConfig:
    """The tiny config of ``model_type`` (``overrides`` on top: a vocabulary size...)."""
    config_class = CONFIG_MAPPING[model_type]
    default = config_class()
    names = getattr(config_class, "attribute_map", {})
    kwargs = {names.get(key, key): value for key, value in SHRINK.items() if _present(default, key)}
    if "qk_rope_head_dim" in kwargs:  # multi-head latent attention: a key head per query head
        kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]
        if "head_dim" in kwargs:  # rotary on the rope part only
            kwargs["head_dim"] = kwargs["qk_rope_head_dim"]
    kwargs |= OVERRIDES.get(model_type, {}) | overrides
    for key, value in vars(default).items():  # every other MLP width
        if "intermediate_size" in key and isinstance(value, int) and key not in kwargs:
            kwargs[key] = 48
    _per_layer_kinds(default, kwargs)
    return config_class(**kwargs)


def build(model_type: str, seed: int = 0, **overrides) -> nn.Module:
    """A tiny random ``model_type`` causal LM in eval mode, float32: its norms and biases
    moved off their initial values, its routers' weights N(0, 0.5) so choices are clear."""
    if model_type in UNBUILDABLE:
        raise ValueError(f"{model_type}: {UNBUILDABLE[model_type]}")
    config = config_of(model_type, **overrides)
    torch.manual_seed(seed)
    model = _causal_lm_class(model_type)(config).float().eval()
    _move_off_init(model)
    return model


def _move_off_init(model: nn.Module) -> None:
    """Norms and biases a little off their initial values, so that they matter; router
    weights N(0, 0.5) and routing score biases N(0, 0.1), so that choices are clear."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    with torch.no_grad():
        for name, tensor in tensors:
            owner, _, leaf = name.rpartition(".")
            routing = bool(set(owner.split(".")) & ROUTERS)
            if not tensor.is_floating_point():
                if routing:  # a token -> experts table (DeepSeek-V4's hash routing)
                    experts = model.get_submodule(owner).weight.shape[0]
                    table = torch.rand(len(tensor), experts).argsort(-1)
                    tensor.copy_(table[:, : tensor.shape[1]])
            elif "bias" in leaf and (routing or not isinstance(tensor, nn.Parameter)):
                tensor.normal_(0, 0.1)  # e_score_correction_bias, expert_bias, ...
            elif not isinstance(tensor, nn.Parameter):
                continue  # rotary frequencies and other constants
            elif "norm" in name:
                tensor.add_(torch.randn_like(tensor) * 0.3)
            elif "bias" in leaf:  # no larger than the activations they add to
                tensor.add_(torch.randn_like(tensor) * 0.02)
            elif routing and tensor.dim() == 2:
                tensor.normal_(0, 0.5)
