"""Generation tokens/s with and without speculative decoding, on this machine's CPU.

Workload: a copy task, where speculation has something to find (the answer repeats the
prompt's string, as code edits and summaries quote their input). Two Llama models with the
built-in character tokenizer are warm-started on it (made here, cached like the built-in
model): the policy (~3.4M parameters) and a small draft (~0.1M) that learned the same task, so
it agrees with the policy most of the time. A third model, the draft's shape with no
training, is a draft that disagrees.

Each generate call samples completions of up to ``--tokens`` + 1 new tokens at temperature 1,
for a batch of 64 rows (8 prompts x 8) and of 8 rows (1 prompt x 8). Settings: plain
decoding; prompt lookup (ngram) with k = 2, 4; the agreeing draft with k = 2, 4; MTP heads on
the policy's hidden states (trained first, ``--mtp-steps``) with k = 2, 4; the disagreeing
draft with k = 4 and the automatic switch (speculation turns itself off after the first call
and probes every 20). The calls of all settings are interleaved; ratios are tokens/s against
plain decoding within each block of ``--calls`` calls, median of ``--pairs`` blocks. Writes
benchmarks/results/speculative.{json,md}.

    .venv/bin/python -m benchmarks.speculative [--calls 10] [--pairs 3] [--tokens 48]
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
from honing.rollout.native.engine import TransformersEngine
from honing.rollout.native.mtp import MtpHeads
from honing.rollout.native.speculative import Speculation
from honing.trainer.batch import collate
from honing.trainer.mtp import train_mtp

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
        "mtp_k2": ("mtp", 2, loaded["mtp"]),
        "mtp_k4": ("mtp", 4, loaded["mtp"]),
        "bad_draft_k4_auto": ("draft", 4, loaded["untrained"]),
    }


def train_heads(policy, tokenizer, requests, params, steps: int) -> tuple[MtpHeads, dict]:
    """MTP heads trained as a run trains them (``train_mtp`` on each batch of the policy's
    own samples), here on a policy that stays fixed."""
    heads = MtpHeads(policy.config.hidden_size, 4)
    optimizer = torch.optim.AdamW(heads.parameters(), lr=3e-3)
    engine = TransformersEngine(policy, tokenizer, device=torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    metrics = {}
    for step in range(steps):
        rollouts = engine.generate(
            requests, SamplingParams(**{**params.__dict__, "seed": 10**6 + step})
        )
        batch = collate(rollouts, tokenizer.pad_token_id, torch.device("cpu"))
        metrics = train_mtp(heads, optimizer, policy, batch, generator)
    return heads, metrics


def make_engines(loaded, tokenizer) -> dict:
    engines = {}
    for name, spec in settings(loaded).items():
        speculation = Speculation(spec[0], spec[1], 0.3, 20, spec[2]) if spec else None
        engines[name] = TransformersEngine(
            loaded["policy"], tokenizer, device=torch.device("cpu"), speculation=speculation
        )
    return engines


def run_batch(engines, requests, params, calls: int, pairs: int) -> dict:
    """Every setting's generate call ``calls`` times, interleaved call by call (the order
    rotating), so that drift of the machine's speed hits every setting alike. Each of the
    ``pairs`` blocks of calls gives one ratio per setting against plain decoding."""
    names = list(engines)
    for engine in engines.values():  # warm-up, not timed; the switch starts afresh
        engine.generate(requests[:1], params)
        engine.take_report()
        if engine.speculation is not None:
            engine.speculation.enabled, engine.speculation.calls_off = True, 0
    blocks = [{name: [0, 0.0, 0, []] for name in names} for _ in range(pairs)]
    for call in range(calls * pairs):
        block = blocks[call // calls]
        offset = call % len(names)
        for name in names[offset:] + names[:offset]:
            call_params = SamplingParams(**{**params.__dict__, "seed": call})
            started = time.perf_counter()
            rollouts = engines[name].generate(requests, call_params)
            seconds = time.perf_counter() - started
            metrics, _ = engines[name].take_report()
            entry = block[name]
            entry[0] += sum(len(r.response_ids) for r in rollouts)
            entry[1] += seconds
            entry[2] += "rollout/spec_accept_rate" in metrics
            if "rollout/spec_accept_rate" in metrics:
                entry[3].append(metrics["rollout/spec_accept_rate"])
    summary = {}
    for name in names:
        speeds = [b[name][0] / b[name][1] for b in blocks]
        ratios = [b[name][0] / b[name][1] / (b["plain"][0] / b["plain"][1]) for b in blocks]
        rates = [r for b in blocks for r in b[name][3]]
        summary[name] = {
            "tokens_per_s": statistics.median(speeds),
            "ratio": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
            "accept_rate": statistics.fmean(rates) if rates else None,
            "spec_calls": sum(b[name][2] for b in blocks),
            "calls": calls * pairs,
        }
    return summary


def probe_cost(loaded, tokenizer, requests, params, reps: int = 6) -> dict:
    """What one speculating call with the bad draft costs against a plain call (it stops
    speculating after its first rounds): median of ``reps`` interleaved pairs of calls."""
    plain = TransformersEngine(loaded["policy"], tokenizer, device=torch.device("cpu"))
    ratios = []
    for rep in range(reps):
        bad = TransformersEngine(
            loaded["policy"],
            tokenizer,
            device=torch.device("cpu"),
            speculation=Speculation("draft", 4, 0.3, 20, loaded["untrained"]),
        )
        call = SamplingParams(**{**params.__dict__, "seed": 500 + rep})
        times = []
        for engine in (plain, bad):
            started = time.perf_counter()
            engine.generate(requests, call)
            times.append(time.perf_counter() - started)
        ratios.append(times[1] / times[0])
    return {"call_time_ratio": statistics.median(ratios), "ratios": ratios}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=20, help="calls per block")
    parser.add_argument("--pairs", type=int, default=3, help="blocks (one ratio each)")
    parser.add_argument("--tokens", type=int, default=48, help="copied string length")
    parser.add_argument("--mtp-steps", type=int, default=60, help="MTP heads' training steps")
    args = parser.parse_args()
    host = configure_host(0)
    tokenizer, loaded = models(args.tokens)
    prompts = copy_corpus(8, 1, args.tokens)
    requests = [
        GenerationRequest(f"p{i}", tokenizer.encode(prompt), i)
        for i, (prompt, _) in enumerate(prompts)
    ]
    params = SamplingParams(n=8, max_new_tokens=args.tokens + 1, max_seq_len=128)
    loaded["mtp"], mtp_metrics = train_heads(
        loaded["policy"], tokenizer, requests, params, args.mtp_steps
    )
    print("mtp heads", json.dumps(mtp_metrics), flush=True)
    batches = {"64 rows (8 prompts x 8)": requests, "8 rows (1 prompt x 8)": requests[:1]}
    results = {}
    for label, batch in batches.items():
        engines = make_engines(loaded, tokenizer)
        results[label] = run_batch(engines, batch, params, args.calls, args.pairs)
        print(label, json.dumps(results[label]), flush=True)
    probe = probe_cost(loaded, tokenizer, requests, params)
    params_count = {n: sum(p.numel() for p in m.parameters()) for n, m in loaded.items()}
    mtp_note = (
        f" MTP heads (4, {params_count['mtp'] / 1e6:.2f}M parameters) trained for "
        f"{args.mtp_steps} steps with train_mtp on the policy's own samples first (head 1 "
        f"accuracy {mtp_metrics.get('mtp/accuracy', 0):.2f}, loss "
        f"{mtp_metrics.get('mtp/loss', 0):.2f})."
    )
    record = {
        "command": "python -m benchmarks.speculative "
        f"--calls {args.calls} --pairs {args.pairs} --tokens {args.tokens} "
        f"--mtp-steps {args.mtp_steps}",
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} "
        f"threads, torch {torch.__version__}",
        "host": host,
        "parameters": params_count,
        "mtp_heads_after_training": mtp_metrics,
        "bad_draft_call_cost": probe,
        "results": results,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "speculative.json").write_text(json.dumps(record, indent=1))
    lines = [
        "# Speculative decoding: generation tokens/s on the CPU",
        "",
        f"`{record['command']}` on {record['machine']}. Policy "
        f"{params_count['policy'] / 1e6:.2f}M parameters, agreeing draft "
        f"{params_count['draft'] / 1e6:.2f}M (trained on the same copy task), disagreeing draft "
        f"the same shape untrained; completions of up to {args.tokens + 1} tokens at "
        f"temperature 1. Calls of every setting interleaved; ratio = tokens/s against plain "
        f"decoding in the same block of {args.calls} calls, median (min–max) of {args.pairs} "
        "blocks. The bad draft runs with the automatic switch (rollout.spec_min_accept 0.3, "
        "probe every 20 calls)." + mtp_note,
    ]
    for label, summary in results.items():
        lines += [
            "",
            f"## {label}",
            "",
            "| setting | tokens/s | vs plain | acceptance | calls that speculated |",
            "|---|---|---|---|---|",
        ]
        for name, s in summary.items():
            rate = "–" if s["accept_rate"] is None else f"{s['accept_rate']:.2f}"
            lines.append(
                f"| {name} | {s['tokens_per_s']:.0f} | {s['ratio']:.2f}× "
                f"({s['ratio_min']:.2f}–{s['ratio_max']:.2f}) | {rate} | "
                f"{s['spec_calls']} / {s['calls']} |"
            )
    lines += [
        "",
        "One call that speculates with the bad draft (the first call, and each probe) against a "
        f"plain call, 64 rows, median of {len(probe['ratios'])} interleaved pairs: "
        f"{probe['call_time_ratio']:.2f}× the time (it stops speculating after 4 rounds); with "
        "a probe every 20 calls that is the switch's whole cost.",
    ]
    (RESULTS / "speculative.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
