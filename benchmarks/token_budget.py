"""Token-budget micro-batches against sequence-count ones: the policy update's step time on a
mixed-length batch (a few long sequences among many short ones).

The workload: grpo_step's random ~47M-parameter model (``M50``: a Qwen2, Llama-family for the
packed forward; hidden 512, 10 layers, 8 heads over 2 KV heads, 32k vocabulary; made under
runs/bench/models/ with 4,096 positions); one mini-batch of ``--rows`` sequences, ``--long-rows``
of them ``--long`` tokens and the rest ``--short`` (a 64-token prompt each, the rest
response); one GRPO update of it per step (``trainer.policy_update.update_policy``, one
process, AdamW, on-policy, the packed forward, bfloat16 autocast on CUDA).

The splits compared (``--budget``, ``--counts``):

- ``tokens=B``: ``trainer.max_tokens_per_micro=B``, rows packed longest first under B padded
  tokens (with the defaults each long row alone, the short ones together);
- ``count=m``: ``trainer.micro_batch_size=m`` in batch order. A micro-batch holding a long row
  pads every row of it to the long width, so only ``count=1`` keeps the token budget's peak
  (one long row); larger counts are shown with the peak they reach instead.

Per split: the median update time over ``--steps`` steps a round (the first of each round is
warm-up and dropped) and ``--rounds`` rounds that alternate the splits, so drift affects all
alike; micro-batches per step; the activation peak (``memory/activation_peak_mb``: the most
bytes one micro-batch's forward kept for its backward); the largest micro-batch in padded
tokens (rows x widest row:
what the padded forward holds; the packed forward holds no more); on CUDA the peak memory
allocated during the update.

    .venv/bin/python -m benchmarks.token_budget [--quick] [--budget 2048] [--counts 1,4]

Writes benchmarks/results/token_budget.{json,md} (``--quick``: token_budget_quick.*, grpo_step's
0.6M-parameter peer model and a small batch, seconds, to check the script runs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import replace
from pathlib import Path

from benchmarks.grpo_step import M50, PEER, SEED
from benchmarks.grpo_workloads import ModelSpec, build_model_dir
from benchmarks.moe import cpu_model

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
WORK = ROOT / "runs" / "bench"
PROMPT = 64


def build_model(spec: ModelSpec, device):
    """grpo_step's random model of ``spec`` (its directory under runs/bench/models/, made once),
    fp32, train mode, SDPA attention."""
    from honing.models.loading import load_causal_lm, load_tokenizer

    model_dir = WORK / "models" / spec.name
    build_model_dir(spec, model_dir, SEED)
    tokenizer = load_tokenizer(model_dir)
    model = load_causal_lm(model_dir, tokenizer, dtype="float32", device=device).train()
    model.set_attn_implementation("sdpa")
    return model


def mixed_batch(lengths: list[int], vocab: int, device):
    """Rollouts of ``lengths`` tokens in all (a 64-token prompt each, random ids), collated."""
    import torch

    from honing.trainer.batch import collate
    from honing.types import Rollout

    ids = torch.Generator().manual_seed(1)
    rows = [torch.randint(3, vocab, (length,), generator=ids).tolist() for length in lengths]
    rollouts = [
        Rollout(
            f"p{i}", i, row[:PROMPT], row[PROMPT:], [0.0] * (len(row) - PROMPT), "length", 0, ""
        )
        for i, row in enumerate(rows)
    ]
    return collate(rollouts, 0, device)


def batch_lengths(rows: int, long_rows: int, long: int, short: int) -> list[int]:
    """``rows`` lengths, the long ones spread through the batch (never two side by side)."""
    lengths = [short] * rows
    for k in range(long_rows):
        lengths[k * rows // long_rows] = long
    return lengths


def largest_micro_batch(batch, settings) -> int:
    """The split's largest micro-batch in padded tokens (rows x widest row)."""
    import torch

    from honing.trainer.layouts import OneProcess
    from honing.trainer.policy_update import row_tokens

    tokens = row_tokens(batch)
    split = OneProcess().rows(
        torch.arange(len(batch)), settings.micro_batch_size, tokens, settings.max_tokens_per_micro
    )
    return max(len(chunk) * int(tokens[chunk].max()) for chunk, _ in split)


def timed_update(trainer, batch, advantages, settings) -> tuple[float, dict, int]:
    """One update: seconds, its metrics, and on CUDA the peak bytes allocated during it."""
    import torch

    from honing.trainer.policy_update import update_policy

    cuda = batch.input_ids.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    metrics = update_policy(trainer, batch, advantages, settings)
    if cuda:
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() if cuda else 0
    return time.perf_counter() - started, metrics, peak


def measure(args) -> dict:
    """Every split's samples over alternating rounds, then their medians."""
    import torch

    from honing.trainer.engine import TrainedModule
    from honing.trainer.policy_update import UpdateSettings

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    spec = PEER if args.quick else replace(M50, name="m50_v32k_p4096", max_positions=4096)
    lengths = batch_lengths(args.rows, args.long_rows, args.long, args.short)
    model = build_model(spec, device)
    trainer = TrainedModule("policy", model, torch.optim.AdamW(model.parameters(), lr=1e-6))
    batch = mixed_batch(lengths, model.config.vocab_size, device)
    advantages = torch.randn(batch.responses.shape, generator=torch.Generator().manual_seed(2))
    advantages = advantages.to(device) * batch.response_mask
    base = UpdateSettings(grad_clip=1.0, autocast="bfloat16" if device.type == "cuda" else "none")
    splits = {f"tokens={args.budget}": {"max_tokens_per_micro": args.budget}}
    splits |= {f"count={m}": {"micro_batch_size": m} for m in args.counts}
    settings = {name: replace(base, **options) for name, options in splits.items()}
    samples = {name: {"seconds": [], "peak_bytes": []} for name in splits}
    micro_batches, activation = {}, {}
    for _ in range(args.rounds):  # alternating, so drift affects every split alike
        for name, chosen in settings.items():
            for step in range(args.steps + 1):
                seconds, metrics, peak = timed_update(trainer, batch, advantages, chosen)
                if step:  # the first of each round warms up
                    samples[name]["seconds"].append(seconds)
                    samples[name]["peak_bytes"].append(peak)
                micro_batches[name] = metrics["perf/micro_batches"]
                activation[name] = metrics["memory/activation_peak_mb"]
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model(),
        "parameters": sum(p.numel() for p in model.parameters()),
        "lengths": lengths,
        "splits": {
            name: {
                "median_update_s": statistics.median(samples[name]["seconds"]),
                "seconds": samples[name]["seconds"],
                "micro_batches": micro_batches[name],
                "largest_micro_batch_tokens": largest_micro_batch(batch, settings[name]),
                "peak_mb": max(samples[name]["peak_bytes"]) / 2**20,
                "activation_peak_mb": activation[name],
            }
            for name in splits
        },
    }


def table(result: dict, command: str) -> list[str]:
    splits = result["splits"]
    budget = next(iter(splits))
    lines = [
        f"`{command}` on {result['device']} ({os.cpu_count()} CPU cores): one update of "
        f"{len(result['lengths'])} sequences ({result['lengths'].count(max(result['lengths']))}"
        f" of {max(result['lengths'])} tokens, the rest {min(result['lengths'])}), a "
        f"{result['parameters'] / 1e6:.1f}M-parameter Qwen2, random weights; medians over "
        "alternating rounds",
        "",
        "| split | update s (median) | vs token budget | micro-batches | largest micro-batch, "
        "padded tokens | activation peak MB (saved for backward) | peak MB (CUDA) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, s in splits.items():
        ratio = s["median_update_s"] / splits[budget]["median_update_s"]
        peak = f"{s['peak_mb']:,.0f}" if s["peak_mb"] else "–"  # measured on CUDA only
        lines.append(
            f"| {name} | {s['median_update_s']:.3f} | {ratio:.2f}x | {s['micro_batches']:.0f} | "
            f"{s['largest_micro_batch_tokens']:,} | {s['activation_peak_mb']:,.0f} | {peak} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model and batch: seconds")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--long-rows", type=int, default=2)
    parser.add_argument("--long", type=int, default=0, help="tokens (default 2048; quick 256)")
    parser.add_argument("--short", type=int, default=0, help="tokens (default 128; quick 80)")
    parser.add_argument("--budget", type=int, default=0, help="tokens (default: --long)")
    parser.add_argument("--counts", default="1,4", help="micro_batch_size values")
    parser.add_argument("--steps", type=int, default=0, help="per round (default 5; quick 1)")
    parser.add_argument("--rounds", type=int, default=0, help="(default 3; quick 1)")
    parser.add_argument("--device", default="", help="default: cuda when there is one")
    args = parser.parse_args()
    args.long = args.long or (256 if args.quick else 2048)
    args.short = args.short or (80 if args.quick else 128)
    args.budget = args.budget or args.long
    args.counts = [int(x) for x in args.counts.split(",")]
    args.steps = args.steps or (1 if args.quick else 5)
    args.rounds = args.rounds or (1 if args.quick else 3)
    started = time.perf_counter()
    result = measure(args)
    options = (
        f"--rows {args.rows} --long-rows {args.long_rows} --long {args.long} --short "
        f"{args.short} --budget {args.budget} --counts {','.join(map(str, args.counts))} "
        f"--steps {args.steps} --rounds {args.rounds}"
    )
    command = f"python -m benchmarks.token_budget {'--quick ' if args.quick else ''}{options}"
    result |= {
        "command": command,
        "machine": f"{cpu_model()}, {os.cpu_count()} cores",
        "seconds": round(time.perf_counter() - started, 1),
    }
    lines = table(result, command)
    name = "token_budget_quick" if args.quick else "token_budget"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=1))
    (RESULTS / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
