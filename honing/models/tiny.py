"""The embedded tiny model: built locally, offline, in standard Hugging Face format.

A character-level tokenizer (printable ASCII, one token per character, ``<pad>`` distinct from
``<eos>``) and a ~0.9M-parameter Llama (``builtin:tiny``) or a ~2.7M-parameter Qwen3-MoE with
8 experts, 2 per token (``builtin:tiny-moe``, ``TinySpec.experts``) are created from a seed,
then given a short supervised warm start on (prompt, completion) pairs supplied by the
caller, so that RL has something to improve. The result is an ordinary model directory
(``config.json``, ``model.safetensors``, ``tokenizer.json``) that ``AutoModelForCausalLM``
and ``AutoTokenizer`` load.

The directory is cached under a key derived from every build setting and the corpus, so a
second build with the same inputs is a no-op. It is written to a temporary name and renamed,
so an interrupted build is never mistaken for a finished one.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from honing.data.arithmetic import warmstart_corpus
from honing.rollout.tools.calculator import calculate
from honing.rollout.tools.calls import FORMATS, ToolResponses, ToolResult

PAD, EOS, BOS, UNK = "<pad>", "<eos>", "<bos>", "<unk>"


@dataclass(frozen=True)
class TinySpec:
    """Architecture and warm-start settings of the embedded model."""

    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    intermediate_size: int = 384
    max_positions: int = 64
    warmstart_steps: int = 1200
    warmstart_batch: int = 128
    warmstart_lr: float = 3e-3
    seed: int = 0
    experts: int = 0  # > 0: an MoE with this many experts in every layer
    family: str = "qwen3_moe"  # the MoE's transformers family: qwen3_moe or gpt_oss
    experts_per_token: int = 2
    expert_size: int = 192  # each expert's intermediate size
    # the warm start's load-balancing loss (as MoE pretraining keeps one: experts stay used)
    router_aux_coef: float = 0.01
    # the tokenizer also has the Hermes tool-call tags as special tokens (builtin:tiny-tools)
    tool_tags: bool = False


# builtin:tiny. Its warm start runs at 1e-3: at 3e-3 it sometimes stalled half-trained, and
# where depended on the CPU's kernels (the demo started at 0.380 greedy accuracy on AVX-512
# and 0.530 on AVX2 kernels, and ended 33 points apart); at 1e-3 it converges on every kernel
# path measured (benchmarks/results/demo_kernels.md).
TINY = TinySpec(warmstart_lr=1e-3)
TINY_MOE = TinySpec(experts=8)  # builtin:tiny-moe
# builtin:tiny-tools: a call, its response and the answer take ~130 tokens. 400 steps at 1e-3
# (was 2000 at 3e-3, a half-hour build on a 2-core VM): greedy, it calls on every held-out
# problem and copies the calculator's result into about half of its answers; at temperature
# 1 most of its calls are malformed, so the demo samples at 0.5 (examples/arithmetic_tools.yaml).
TINY_TOOLS = TinySpec(
    warmstart_steps=400, warmstart_lr=1e-3, warmstart_batch=32, max_positions=192, tool_tags=True
)
# Its corpus: 8-digit operands, which the model cannot add itself; the teacher drops the
# carries as builtin:tiny's does, and calls the calculator on TOOLS_CALL_SHARE of them.
TOOLS_CORPUS_SIZE = 20000
TOOLS_DIGITS = (8, 8)
TOOLS_SLIP_RATE = 0.7
TOOLS_CALL_SHARE = 0.3


def tools_corpus() -> list[tuple[str, str]]:
    """builtin:tiny-tools' warm-start corpus (training pairs only)."""
    low, high = TOOLS_DIGITS
    problems = warmstart_corpus(
        TOOLS_CORPUS_SIZE, seed=0, max_digits=high, min_digits=low, slip_rate=TOOLS_SLIP_RATE
    )
    return tool_corpus(problems, TOOLS_CALL_SHARE, seed=0)


def tool_corpus(corpus: list[tuple[str, str]], call_share: float, seed: int):
    """``corpus`` with a ``call_share`` of its problems answered through the calculator.

    Such a completion is the Hermes call of the calculator on the prompt's expression (the
    prompt less its ``=``), the tool response as the turn loop renders it for the
    ``tool_tags`` tokenizer (``rollout/tools/calls.ToolResponses``), then the calculator's
    exact answer; the other completions stay as they were.
    """
    fmt, responses = FORMATS["hermes"], ToolResponses(build_tokenizer(tool_tags=True))
    rng = random.Random(f"tool-corpus:{seed}:{call_share}")
    out = []
    for prompt, completion in corpus:
        if rng.random() >= call_share:
            out.append((prompt, completion))
            continue
        expression = prompt.removesuffix("=")
        arguments = {"name": "calculator", "arguments": {"expression": expression}}
        call = fmt.open + json.dumps(arguments) + fmt.close
        answer = calculate(expression)
        out.append(
            (prompt, call + responses.text(call, [ToolResult("calculator", answer)]) + answer)
        )
    return out


def build_tokenizer(tool_tags: bool = False):
    """A character-level fast tokenizer over printable ASCII with pad != eos; with
    ``tool_tags``, also the newline (tool responses are lines) and the Hermes
    ``<tool_call>`` and ``</tool_call>``, one token each."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = [PAD, EOS, BOS, UNK]
    chars = [chr(c) for c in range(32, 127)] + (["\n"] if tool_tags else [])  # tool responses'
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    one_char = Regex(".|\n") if tool_tags else Regex(".")
    core.pre_tokenizer = pre_tokenizers.Split(one_char, behavior="isolated")
    core.decoder = decoders.Fuse()
    tags = [FORMATS["hermes"].open, FORMATS["hermes"].close] if tool_tags else []
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        eos_token=EOS,
        bos_token=BOS,
        unk_token=UNK,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        **({"additional_special_tokens": tags} if tags else {}),
    )


def _new_model(spec: TinySpec, tokenizer):
    from transformers import (
        GptOssConfig,
        GptOssForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    common = {
        "vocab_size": len(tokenizer),
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_heads,
        "max_position_embeddings": spec.max_positions,
        "tie_word_embeddings": True,
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.bos_token_id,
    }
    if spec.experts and spec.family == "gpt_oss":  # its router: a softmax of the top-k logits
        config = GptOssConfig(
            **common | {"intermediate_size": spec.expert_size},
            num_local_experts=spec.experts,
            num_experts_per_tok=spec.experts_per_token,
            head_dim=spec.hidden_size // spec.num_heads,
            sliding_window=spec.max_positions,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
        model_class = GptOssForCausalLM
    elif spec.experts:
        config = Qwen3MoeConfig(
            **common,
            moe_intermediate_size=spec.expert_size,
            num_experts=spec.experts,
            num_experts_per_tok=spec.experts_per_token,
            norm_topk_prob=True,
            head_dim=spec.hidden_size // spec.num_heads,
        )
        model_class = Qwen3MoeForCausalLM
    else:
        config, model_class = LlamaConfig(**common), LlamaForCausalLM
    torch.manual_seed(spec.seed)
    return model_class(config)


def _encode_pairs(tokenizer, corpus: list[tuple[str, str]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded token ids and a loss mask that covers only the completion and its EOS."""
    rows, masks = [], []
    for prompt, completion in corpus:
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
        completion_ids = tokenizer.encode(completion, add_special_tokens=False)
        rows.append(prompt_ids + completion_ids + [tokenizer.eos_token_id])
        masks.append([0] * len(prompt_ids) + [1] * (len(completion_ids) + 1))
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    loss_mask = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, (r, m) in enumerate(zip(rows, masks, strict=True)):
        ids[i, : len(r)] = torch.tensor(r)
        loss_mask[i, : len(m)] = torch.tensor(m, dtype=torch.float32)
    return ids, loss_mask


def warm_start(model, tokenizer, corpus: list[tuple[str, str]], spec: TinySpec) -> list[float]:
    """Supervised fine-tuning on the completions only; returns the loss every 100 steps."""
    ids, loss_mask = _encode_pairs(tokenizer, corpus)  # [N, T]
    attention = (ids != tokenizer.pad_token_id).long()
    lengths = attention.sum(1)
    generator = torch.Generator().manual_seed(spec.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.warmstart_lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=spec.warmstart_lr, total_steps=spec.warmstart_steps, pct_start=0.1
    )
    model.train()
    losses = []
    for step in range(spec.warmstart_steps):
        index = torch.randint(0, ids.shape[0], (spec.warmstart_batch,), generator=generator)
        groups = _length_groups(index, lengths) if spec.tool_tags else [(index, ids.shape[1])]
        balance = {"output_router_logits": True} if spec.experts else {}
        loss_sum = 0.0
        for rows, width in groups:
            part = (ids[rows, :width], loss_mask[rows, :width], attention[rows, :width])
            part_sum, out = _loss_sum(model, *part, **balance)
            loss_sum = loss_sum + part_sum
        loss = loss_sum / loss_mask[index, 1:].sum()
        if spec.experts:
            loss = loss + spec.router_aux_coef * out.aux_loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 100 == 0 or step == spec.warmstart_steps - 1:
            losses.append(round(loss.item(), 4))
    model.eval()
    return losses


def _loss_sum(model, batch, mask, attention, **kwargs):
    """The summed next-token loss of ``batch``'s masked tokens, and the model's output."""
    out = model(input_ids=batch, attention_mask=attention, **kwargs)
    logits = out.logits  # [B, T, V]
    # Token t predicts token t+1: shift so each target lines up with its logits.
    token_loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="none"
    ).view(batch.shape[0], -1)
    return (token_loss * mask[:, 1:]).sum(), out


BUCKET_TOKENS = 32


def _length_groups(index: torch.Tensor, lengths: torch.Tensor) -> list[tuple[torch.Tensor, int]]:
    """``index``'s rows grouped by length in steps of ``BUCKET_TOKENS``, each group with its
    longest row: a forward pass per group keeps the short rows (direct answers) from paying
    for the long ones' (tool calls) padding; their summed losses are the whole batch's."""
    group = torch.div(lengths[index] - 1, BUCKET_TOKENS, rounding_mode="floor")
    parts = [index[group == g] for g in group.unique()]
    return [(rows, int(lengths[rows].max())) for rows in parts]


def cache_key(spec: TinySpec, corpus: list[tuple[str, str]]) -> str:
    settings = asdict(spec)
    if not spec.tool_tags:  # the key predates the tool tokenizer
        settings.pop("tool_tags")
    if not spec.experts:  # the dense model's key predates the MoE settings
        for key in ("experts", "experts_per_token", "expert_size", "router_aux_coef"):
            settings.pop(key)
    if spec.family == "qwen3_moe":  # and the Qwen3-MoE's predates the family
        settings.pop("family")
    digest = hashlib.sha256(json.dumps([settings, corpus]).encode())
    return digest.hexdigest()[:16]


def build_tiny_model(
    cache_dir: str | Path, corpus: list[tuple[str, str]], spec: TinySpec = TINY, log=print
) -> Path:
    """Return the directory of the warm-started tiny model, building it if not cached."""
    name = (
        ("tiny-tools" if spec.tool_tags else "tiny")
        if not spec.experts
        else "tiny-moe" + ("" if spec.family == "qwen3_moe" else f"-{spec.family}")
    )
    target = Path(cache_dir) / f"{name}-{cache_key(spec, corpus)}"
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    from honing.models.loading import quiet_transformers

    quiet_transformers()
    started = time.perf_counter()
    torch.manual_seed(spec.seed)
    tokenizer = build_tokenizer(spec.tool_tags)
    model = _new_model(spec, tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"building the {name} model ({n_params / 1e6:.2f}M parameters) with a warm start ...")
    losses = warm_start(model, tokenizer, corpus, spec)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-tiny-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        info = {"spec": asdict(spec), "corpus_size": len(corpus), "warmstart_losses": losses}
        (tmp / "honing_tiny.json").write_text(json.dumps(info, indent=1))
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(f"{name} model ready in {time.perf_counter() - started:.0f}s: {target}")
    return target
