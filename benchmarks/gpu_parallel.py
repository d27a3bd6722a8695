"""The expert-parallel experts on one device, for ``benchmarks/gpu_checks.py``: a random
Qwen3-MoE's forward and backward through its own experts and through
``ExpertParallelExperts`` over a process group of one rank (the dispatch's gather, sort and
``all_to_all_single`` run; every expert is local), in bfloat16 on CUDA (where ``grouped_mm``
takes the experts) or float32 on a CPU. Reported: each one's median seconds over the timed
passes, the largest logit gap between them, the expert weights' bytes, and whether
``grouped_mm`` ran. (Expert and tensor parallelism across ranks need several devices; a
one-device machine measures the kernels they run.)"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

SHAPES = {  # (hidden, layers, experts, top-k, expert width, vocabulary, rows, tokens)
    "0.5b": (1024, 4, 32, 8, 512, 32000, 8, 512),
    "tiny": (64, 2, 8, 2, 32, 1000, 2, 16),
}


def _model(size: str, device: torch.device, dtype: torch.dtype):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    hidden, layers, experts, top_k, width, vocab, _, _ = SHAPES[size]
    config = Qwen3MoeConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=hidden // 8,
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=width,
        intermediate_size=4 * hidden,
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(config).to(device=device, dtype=dtype)


def _timed(
    model, ids: torch.Tensor, device: torch.device, passes: int
) -> tuple[float, torch.Tensor]:
    """The median seconds of a forward and backward of ``ids``, and the logits of the last."""
    seconds, logits = [], None
    for _ in range(passes + 1):  # the first warms up
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        logits = model(input_ids=ids).logits
        logits.float().logsumexp(-1).mean().backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds[1:]), logits.detach().float()


def expert_parallel_one_rank(device: torch.device, size: str, passes: int = 5) -> dict:
    """The experts' own forward and backward against ``ExpertParallelExperts`` over one
    rank (see the module)."""
    from honing.trainer import expert_parallel

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    started = not dist.is_initialized()
    if started:
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method="tcp://127.0.0.1:29531", rank=0, world_size=1)
    try:
        rows, tokens = SHAPES[size][6:]
        ids = torch.randint(
            0, SHAPES[size][5], (rows, tokens), generator=torch.Generator().manual_seed(1)
        )
        ids = ids.to(device)
        model = _model(size, device, dtype)
        own, want = _timed(model, ids, device, passes)
        shards = expert_parallel.apply_expert_parallel(model, dist.group.WORLD)
        weight = next(iter(shards.modules.values())).down_proj.to_local()
        parallel, got = _timed(model, ids, device, passes)
    finally:
        if started:
            dist.destroy_process_group()
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "rows_x_tokens": f"{rows} x {tokens}",
        "own_experts_s": own,
        "expert_parallel_s": parallel,
        "ratio": parallel / own,
        "logit_gap": float((got - want).abs().max()),
        "expert_mb": shards.expert_bytes() / 2**20,
        "grouped_mm": expert_parallel.grouped_mm_fits(weight, dtype),
    }
