"""Generation tokens/s with and without speculative decoding, on this machine's CPU.

Workload: a copy task, where speculation has something to find (the answer repeats the
prompt's string, as code edits and summaries quote their input). Two Llama models with the
built-in character tokenizer are warm-started on it (made here, cached like the built-in
model): the policy (~2.4M parameters) and a small draft (~0.1M) that learned the same task, so
it agrees with the policy most of the time. A third model, the draft's shape with no
training, is a draft that disagrees.

Each generate call samples 8 prompts x 8 completions of up to ``--tokens`` new tokens at
temperature 1. Settings, each timed over ``--calls`` calls, ``--pairs`` times in alternating
order (medians reported): plain decoding; prompt lookup (ngram) with k = 2, 4; the agreeing
draft with k = 2, 4; the disagreeing draft with k = 4 and the automatic switch (speculation
turns itself off after the first call and probes every 20). Ratios are tokens/s against plain
decoding measured in the same pair. Writes benchmarks/results/speculative.{json,md}.

    .venv/bin/python -m benchmarks.speculative [--calls 20] [--pairs 3] [--tokens 48]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path

import torch

from honing.host import configure_host
from honing.models.loading import load_causal_lm, load_tokenizer
from honing.models.tiny import TinySpec, build_tiny_model
from honing.rollout.base import GenerationRequest, SamplingParams
from honing.rollout.speculative import Speculation
from honing.rollout.transformers_engine import TransformersEngine

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
CACHE = Path.home() / ".cache" / "honing" / "bench-speculative"
ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789"
POLICY = TinySpec(
    hidden_size=256,
    num_layers=4,
    num_heads=4,
    intermediate_size=768,
    max_positions=128,
    warmstart_steps=500,
    warmstart_batch=32,
    warmstart_lr=2e-3,
)
DRAFT = TinySpec(
    hidden_size=64,
    num_layers=2,
    num_heads=2,
    intermediate_size=192,
    max_positions=128,
    warmstart_steps=500,
    warmstart_batch=32,
    warmstart_lr=3e-3,
)
UNTRAINED = TinySpec(**{**DRAFT.__dict__, "warmstart_steps": 1, "seed": 5})


def copy_corpus(size: int, seed: int, length: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    corpus = []
    for _ in range(size):
        text = "".join(rng.choice(ALPHABET) for _ in range(length))
        corpus.append((f"copy {text}:", text))
    return corpus


def models(length: int):
    corpus = copy_corpus(4000, 0, length)
    paths = {
        name: build_tiny_model(CACHE, corpus, spec)
        for name, spec in (("policy", POLICY), ("draft", DRAFT), ("untrained", UNTRAINED))
    }
    tokenizer = load_tokenizer(paths["policy"])
    loaded = {
        name: load_causal_lm(path, tokenizer, dtype="float32", device="cpu").eval()
        for name, path in paths.items()
    }
    return tokenizer, loaded


def settings(loaded) -> dict:
    return {
        "plain": None,
        "ngram_k2": ("ngram", 2, None),
        "ngram_k4": ("ngram", 4, None),
        "draft_k2": ("draft", 2, loaded["draft"]),
        "draft_k4": ("draft", 4, loaded["draft"]),
        "bad_draft_k4_auto": ("draft", 4, loaded["untrained"]),
    }


def time_calls(engine, requests, params, calls: int) -> dict:
    tokens, started = 0, time.perf_counter()
    rates = []
    for call in range(calls):
        rollouts = engine.generate(requests, SamplingParams(**{**params.__dict__, "seed": call}))
        tokens += sum(len(r.response_ids) for r in rollouts)
        metrics, _ = engine.take_report()
        if "rollout/spec_accept_rate" in metrics:
            rates.append(metrics["rollout/spec_accept_rate"])
    seconds = time.perf_counter() - started
    return {
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "spec_calls": len(rates),
        "accept_rate": statistics.fmean(rates) if rates else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=48, help="copied string length")
    args = parser.parse_args()
    host = configure_host(0)
    tokenizer, loaded = models(args.tokens)
    prompts = copy_corpus(8, 1, args.tokens)
    requests = [
        GenerationRequest(f"p{i}", tokenizer.encode(prompt), i)
        for i, (prompt, _) in enumerate(prompts)
    ]
    params = SamplingParams(n=8, max_new_tokens=args.tokens + 1, max_seq_len=128)
    runs: dict[str, list] = {name: [] for name in settings(loaded)}
    for pair in range(args.pairs):
        names = list(runs) if pair % 2 == 0 else list(reversed(runs))
        for name in names:
            spec = settings(loaded)[name]
            speculation = Speculation(spec[0], spec[1], 0.3, 20, spec[2]) if spec else None
            engine = TransformersEngine(
                loaded["policy"], tokenizer, device=torch.device("cpu"), speculation=speculation
            )
            engine.generate(requests[:1], params)  # warm-up, not timed
            engine.take_report()
            if speculation is not None:
                speculation.enabled, speculation.calls_off = True, 0
            runs[name].append(time_calls(engine, requests, params, args.calls))
            print(name, pair, json.dumps(runs[name][-1]), flush=True)
    summary = {}
    for name, results in runs.items():
        ratios = [
            r["tokens_per_s"] / p["tokens_per_s"]
            for r, p in zip(results, runs["plain"], strict=True)
        ]
        summary[name] = {
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in results),
            "ratio": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
            "accept_rate": statistics.median(
                [r["accept_rate"] for r in results if r["accept_rate"] is not None] or [0.0]
            ),
            "spec_calls": results[0]["spec_calls"],
        }
    params_count = {n: sum(p.numel() for p in m.parameters()) for n, m in loaded.items()}
    record = {
        "command": "python -m benchmarks.speculative "
        f"--calls {args.calls} --pairs {args.pairs} --tokens {args.tokens}",
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} "
        f"threads, torch {torch.__version__}",
        "host": host,
        "parameters": params_count,
        "summary": summary,
        "runs": runs,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "speculative.json").write_text(json.dumps(record, indent=1))
    lines = [
        "# Speculative decoding: generation tokens/s on the CPU",
        "",
        f"`{record['command']}` on {record['machine']}. Policy "
        f"{params_count['policy'] / 1e6:.2f}M parameters, draft "
        f"{params_count['draft'] / 1e6:.2f}M; 64 completions of up to {args.tokens + 1} tokens "
        f"per call, {args.calls} calls per run, medians of {args.pairs} alternating pairs.",
        "",
        "| setting | tokens/s | vs plain (min–max) | acceptance | calls that speculated |",
        "|---|---|---|---|---|",
    ]
    for name, s in summary.items():
        lines.append(
            f"| {name} | {s['tokens_per_s']:.0f} | {s['ratio']:.2f}× "
            f"({s['ratio_min']:.2f}–{s['ratio_max']:.2f}) | {s['accept_rate']:.2f} | "
            f"{s['spec_calls']} / {args.calls} |"
        )
    (RESULTS / "speculative.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
