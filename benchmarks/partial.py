"""Partial rollouts on a long-tail workload: sync, one_step, async and async with
``schedule.partial_rollout``, side by side.

The workload: the demo's addition task with a tiny model that sometimes rambles. It is the
built-in tiny Llama's shape, warm-started on the demo's sloppy teacher, except that one
answer in ``--ramble`` (default 8) goes on after the sum with a line of ``--ramble-len``
digits and spaces before its end of sequence; sampled with ``rollout.max_new_tokens`` 64,
a few samples per batch are 10x longer than the median (the lengths each run saw are in
the table). Each schedule trains ``--steps`` steps, ``--rounds`` times, alternating; the
figures are medians over rounds:

- generated tokens per second: the response tokens of the trained batches over the
  training time (first step's start to the last step's end);
- the trainer's idle time per step (``timing_s/trainer_idle``: waiting for a batch);
- the engine's idle time per step (``timing_s/engine_idle``: waiting for admission);
- with ``schedule.partial_kv=keep``: the cache tokens continued samples reused per step
  (``partial/kv_kept_tokens``), and for every schedule the engine/trainer gap of the trained
  tokens (``rollout_mismatch/kl``), which keeping an older cache widens.

    .venv/bin/python -m benchmarks.partial [--steps 30] [--rounds 2]
    .venv/bin/python -m benchmarks.partial learn [--seeds 2]   # the demo: learning parity

Writes benchmarks/results/partial.{json,md} (learn: partial_learn.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.moe import cpu_model

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
CONFIG = "examples/arithmetic.yaml"
COMMON = [
    "rollout.max_new_tokens=64",
    "rollout.max_seq_len=96",
    "trainer.val_every=0",
    "checkpoint.every=0",
    "monitor.console=false",
    "monitor.tensorboard=false",
]
MODES = {
    "sync": ["schedule.mode=sync"],
    "one_step": ["schedule.mode=one_step"],
    "async": ["schedule.mode=async", "schedule.max_staleness=2"],
    "async + partial": [
        "schedule.mode=async",
        "schedule.max_staleness=2",
        "schedule.partial_rollout=true",
        "schedule.partial_chunk_tokens=8",
    ],
    "async + partial, keep KV": [
        "schedule.mode=async",
        "schedule.max_staleness=2",
        "schedule.partial_rollout=true",
        "schedule.partial_chunk_tokens=8",
        "schedule.partial_kv=keep",
    ],
    "async + partial, chunks of 2": [
        "schedule.mode=async",
        "schedule.max_staleness=2",
        "schedule.partial_rollout=true",
        "schedule.partial_chunk_tokens=2",
    ],
    "async + partial, chunks of 2, keep KV": [
        "schedule.mode=async",
        "schedule.max_staleness=2",
        "schedule.partial_rollout=true",
        "schedule.partial_chunk_tokens=2",
        "schedule.partial_kv=keep",
    ],
    "one_step + partial": [
        "schedule.mode=one_step",
        "schedule.partial_rollout=true",
        "schedule.partial_chunk_tokens=8",
    ],
    "async + partial, max_staleness 4": [
        "schedule.mode=async",
        "schedule.max_staleness=4",
        "schedule.partial_rollout=true",
        "schedule.partial_chunk_tokens=8",
    ],
}


def rambling_model(ramble: int, ramble_len: int) -> Path:
    """builtin:tiny's shape and warm start on a corpus where one answer in ``ramble`` goes
    on with a line of digits (cached as the built-in models are)."""
    from honing.config import build_config
    from honing.data import warmstart_corpus
    from honing.models.tiny import TINY, build_tiny_model
    from honing.pipeline.components import (
        TINY_CORPUS_SIZE,
        TINY_MAX_DIGITS,
        TINY_SLIP_RATE,
        cache_dir,
    )

    corpus = warmstart_corpus(
        TINY_CORPUS_SIZE, seed=0, max_digits=TINY_MAX_DIGITS, slip_rate=TINY_SLIP_RATE
    )
    rng = random.Random(0)
    rambled = []
    for prompt, answer in corpus:
        if rng.randrange(ramble) == 0:
            answer += " " + "".join(rng.choice("0123456789 ") for _ in range(ramble_len))
        rambled.append((prompt, answer))
    spec = dataclasses.replace(TINY, max_positions=128)
    return build_tiny_model(cache_dir(build_config({})) / "rambling", rambled, spec)


def run_once(mode: str, model: Path, steps: int, workdir: Path) -> dict:
    run_dir = workdir / mode.replace(" + ", "_").replace(", ", "_").replace(" ", "_")
    command = [sys.executable, "-m", "honing.cli", "train", CONFIG, *COMMON, *MODES[mode]]
    command += [f"model.path={model}", f"trainer.total_steps={steps}"]
    command += ["--output-dir", str(run_dir), "--resume", "never"]
    subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    metrics = sorted((m for m in map(json.loads, lines) if m["step"] >= 1), key=lambda m: m["step"])
    seconds = sum(m["timing_s/step"] for m in metrics)
    tokens = sum(m["response_length/mean"] * m["samples/generated"] for m in metrics)
    return {
        "mode": mode,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "trainer_idle_s": statistics.fmean(m.get("timing_s/trainer_idle", 0.0) for m in metrics),
        "engine_idle_s": statistics.fmean(m.get("timing_s/engine_idle", 0.0) for m in metrics),
        "length_median": statistics.median(m["response_length/p50"] for m in metrics),
        "length_mean": tokens / sum(m["samples/generated"] for m in metrics),
        "ended": sum(m.get("partial/ended_stale", 0) for m in metrics),
        "length_max": max(m["response_length/max"] for m in metrics),
        "stale": sum(m["samples/stale"] for m in metrics),
        "multi_version": sum(m.get("partial/multi_version_samples", 0) for m in metrics),
        "kv_kept": statistics.fmean(m.get("partial/kv_kept_tokens", 0) for m in metrics),
        "mismatch_kl": statistics.fmean(m.get("rollout_mismatch/kl", 0.0) for m in metrics),
        "accuracy": statistics.fmean(m["critic/score/mean"] for m in metrics[-5:]),
    }


def learn(seeds: int) -> list[str]:
    """The demo (examples/arithmetic.yaml, 500 steps) under async and async with partial
    rollouts, ``seeds`` seeds each: validation accuracy at the start, steps 100 / 250 and
    the end."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(seeds):
            for mode in ("async", "async + partial"):
                run_dir = Path(tmp) / f"{mode.replace(' + ', '_')}-{seed}"
                command = [sys.executable, "-m", "honing.cli", "train", CONFIG, *MODES[mode]]
                command += [f"trainer.seed={seed}", "monitor.console=false"]
                command += ["monitor.tensorboard=false", "checkpoint.every=0"]
                command += ["--output-dir", str(run_dir), "--resume", "never"]
                subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
                lines = (run_dir / "metrics.jsonl").read_text().splitlines()
                val = {m["step"]: m.get("val/accuracy") for m in map(json.loads, lines)}
                val = {k: v for k, v in val.items() if v is not None}
                at = " / ".join(f"{val.get(s, float('nan')):.3f}" for s in (0, 100, 250, 500))
                rows.append(f"| {seed} | {mode} | {at} |")
                print(rows[-1])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("command", nargs="?", choices=("speed", "learn"), default="speed")
    parser.add_argument("--seeds", type=int, default=2, help="learn: seeds per schedule")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--ramble", type=int, default=8)
    parser.add_argument("--ramble-len", type=int, default=48)
    args = parser.parse_args()
    if args.command == "learn":
        command = f"python -m benchmarks.partial learn --seeds {args.seeds}"
        table = [
            f"`{command}` ({cpu_model()}, {os.cpu_count()} cores)",
            "",
            "| seed | schedule | val/accuracy at start / 100 / 250 / 500 |",
            "|---|---|---|",
            *learn(args.seeds),
        ]
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "partial_learn.md").write_text("\n".join(table) + "\n")
        print("\n".join(table))
        return
    model = rambling_model(args.ramble, args.ramble_len)
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            order = list(MODES) if round_ % 2 == 0 else list(reversed(MODES))
            for mode in order:
                runs[mode].append(run_once(mode, model, args.steps, Path(tmp) / str(round_)))
                print(mode, json.dumps(runs[mode][-1]))
    rows = []
    base = statistics.median(r["tokens_per_s"] for r in runs["async"])
    for mode, results in runs.items():

        def med(key: str, results=results) -> float:
            return statistics.median(r[key] for r in results)

        rows.append(
            f"| {mode} | {med('tokens_per_s'):.0f} | {med('tokens_per_s') / base:.2f}× | "
            f"{med('seconds') / args.steps:.2f} | {med('trainer_idle_s'):.3f} | "
            f"{med('engine_idle_s'):.3f} | {med('length_mean'):.1f} / "
            f"{med('length_median'):.0f} / {max(r['length_max'] for r in results):.0f} | "
            f"{med('ended'):.0f} | {sum(r['stale'] for r in results)} | "
            f"{med('multi_version'):.0f} | {med('kv_kept'):.0f} | {med('mismatch_kl'):.2e} |"
        )
    machine = f"{cpu_model()}, {os.cpu_count()} cores"
    command = f"python -m benchmarks.partial --steps {args.steps} --rounds {args.rounds}"
    table = [
        f"`{command}` ({machine}; medians over {args.rounds} rounds, alternating)",
        "",
        "| schedule | generated tokens/s | vs async | s/step | trainer idle s/step | "
        "engine idle s/step | trained response length mean / median / max | samples "
        "ended at their deadline (per run) | stale samples | samples over two versions "
        "(per run) | KV tokens kept per step | rollout_mismatch/kl, mean |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *rows,
    ]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "partial.json").write_text(json.dumps({"command": command, "runs": runs}, indent=1))
    (RESULTS / "partial.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))


if __name__ == "__main__":
    main()
