"""The arithmetic of a GRPO step on the random Qwen2 shapes of the benchmarks, and what torch's
own matmuls reach on those shapes on this machine (the practical peak a phase is set beside).

FLOPs count the linear layers (the attention projections, the MLP and the output head: 2 per
multiply-add) and the causal attention's scores and mixing; norms, activations and the
softmax are left out. A forward pass of a sequence of L tokens costs
``2 * matmul_parameters * L + 2 * layers * hidden * L**2``; generation computes each token's
forward once (the cache keeps the rest), so a batch's generation costs the forward of its
finished sequences; a backward pass costs twice its forward.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from benchmarks.grpo_workloads import ModelSpec

THREADS = 2  # the trainer's (trainer.threads in the benchmarks)


def matmul_parameters(spec: ModelSpec) -> int:
    """The weights that multiply activations per token: each layer's projections and MLP,
    and the output head (the embedding lookup is not a multiply)."""
    head_dim = spec.hidden_size // spec.num_heads
    kv = spec.num_kv_heads * head_dim
    h, i = spec.hidden_size, spec.intermediate_size
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * i
    return spec.num_layers * per_layer + spec.vocab_size * h


def forward_flops(spec: ModelSpec, rows: int, length: float) -> float:
    """FLOPs of a forward pass over ``rows`` sequences of ``length`` tokens."""
    linear = 2 * matmul_parameters(spec) * length
    attention = 2 * spec.num_layers * spec.hidden_size * length**2
    return rows * (linear + attention)


def prompt_tokens(model_dir: Path, train_file: Path) -> float:
    """The mean prompt length of ``train_file``'s rows in ``model_dir``'s tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = [json.loads(line) for line in Path(train_file).read_text().splitlines()]
    lengths = [len(tokenizer(row["prompt"])["input_ids"]) for row in rows]
    return statistics.mean(lengths)


def matmul_peaks(spec: ModelSpec, decode_rows: int, train_tokens: int) -> dict:
    """FLOP/s of torch.matmul (fp32, ``THREADS`` threads) on the model's linear shapes:
    with ``train_tokens`` rows (a micro-batch of the update, at most 2,048: its practical
    peak) and with ``decode_rows`` rows (one decode step of the whole batch: generation's)."""
    import torch

    torch.set_num_threads(THREADS)
    h, i = spec.hidden_size, spec.intermediate_size
    kv = spec.num_kv_heads * (h // spec.num_heads)
    shapes = [(h, h), (h, kv), (h, kv), (h, h), (h, i), (h, i), (i, h)]  # a layer's
    head = (h, spec.vocab_size)

    def rate(tokens: int) -> float:
        work = [(torch.randn(tokens, k), torch.randn(k, n)) for k, n in [*shapes, head]]
        counts = [spec.num_layers] * len(shapes) + [1]
        pairs = list(zip(work, counts, strict=True))
        flops = sum(2 * tokens * a.shape[1] * b.shape[1] * c for (a, b), c in pairs)
        times = []
        for _ in range(4):  # the first warms up
            began = time.perf_counter()
            for (a, b), count in pairs:
                for _ in range(count):
                    torch.matmul(a, b)
            times.append(time.perf_counter() - began)
        return flops / statistics.median(times[1:])

    return {"train": rate(min(train_tokens, 2048)), "decode": rate(decode_rows)}


def step_tables(report: dict) -> list[str]:
    """The ``step`` report's markdown: per shape, each engine's phases in seconds and in
    achieved GFLOP/s, beside torch's matmul rate on the model's shapes."""
    lines = []
    for shape, figures in report["shapes"].items():
        spec = ModelSpec(**figures["spec"])
        rows = figures["prompts"] * figures["group"]
        peaks = figures["peaks"]
        lines += [
            f"### {shape}: {figures['prompts']} prompts x {figures['group']}, "
            f"{figures['max_new_tokens']} new tokens",
            "",
            f"torch.matmul on the model's linear shapes ({THREADS} threads): "
            f"{peaks['train'] / 1e9:.0f} GFLOP/s with an update's rows (the practical peak), "
            f"{peaks['decode'] / 1e9:.0f} GFLOP/s with the {rows} rows of one decode step.",
            "",
            "| engine | step s | gen s (GFLOP/s) | reward s | old-logprob pass s | "
            "update s (GFLOP/s, % of peak) | sync s | other s | largest logprob gap |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for engine, results in figures["runs"].items():
            med = {k: statistics.median(r[k] for r in results) for k in results[0]}
            length = figures["prompt_tokens"] + med["response_tokens"]
            forward = forward_flops(spec, rows, length)
            gen = forward / med["timing_s/gen"] / 1e9
            update = 3 * forward / med["timing_s/update"] / 1e9
            phases = sum(med[f"timing_s/{p}"] for p in ("gen", "reward", "old", "update", "sync"))
            gap = max(r["rollout_mismatch/logprob_diff_max"] for r in results)
            lines.append(
                f"| {engine} | {med['timing_s/step']:.2f} | {med['timing_s/gen']:.2f} ({gen:.0f}) "
                f"| {med['timing_s/reward']:.2f} | {med['timing_s/old']:.2f} | "
                f"{med['timing_s/update']:.2f} ({update:.0f}, "
                f"{100 * update * 1e9 / peaks['train']:.0f}%) | {med['timing_s/sync']:.3f} | "
                f"{med['timing_s/step'] - phases:.2f} | {gap:.1e} |"
            )
        lines.append("")
    return lines
