"""Mixture-of-experts measurements on builtin:tiny-moe (examples/arithmetic_moe.yaml).

    .venv/bin/python -m benchmarks.moe replay --steps 24   # routing mismatch, off / R2 / R3
    .venv/bin/python -m benchmarks.moe learn               # GRPO vs GSPO, R3 on and off
    .venv/bin/python -m benchmarks.moe speed --rounds 3    # MoE fast paths vs HF forward

``replay``: under ``schedule.mode=one_step`` (rollouts one version behind) and under
``trainer.autocast=bfloat16`` (the trainer's passes in bf16, generation in float32), each with
``algorithm.routing_replay`` off, R2 and R3: the medians over the steps of
``moe/rollout_router_match`` and ``rollout_mismatch/kl`` (two PPO epochs, so that the old
pass runs and R2 has passes to replay into). ``learn``: the example's budget for each of
GRPO (ppo_clip) and GSPO, with R3 and without; greedy validation accuracy at the start and
the end and the wall time (one seed). ``speed``: the example's steps with the lean paths
(rollout.fast_decode, trainer.packed_forward) on and off, alternating; medians of the
generation and update seconds. Each writes benchmarks/results/moe_<command>.json and .md.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
CONFIG = "examples/arithmetic_moe.yaml"


def train(overrides: list[str]) -> tuple[list[dict], dict, float]:
    """One ``honing train`` of the example with ``overrides``: its step records, summary and
    wall seconds."""
    with tempfile.TemporaryDirectory() as workdir:
        run = Path(workdir) / "run"
        started = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "honing.cli", "train", CONFIG, *overrides]
            + ["--output-dir", str(run), "--resume", "never", "monitor.console=false"],
            check=True,
            cwd=ROOT,
        )
        wall = time.perf_counter() - started
        lines = (run / "metrics.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines]
        summary = json.loads((run / "summary.json").read_text())
    return [r for r in records if "actor/pg_loss" in r], summary, wall


def median(records: list[dict], key: str) -> float | None:
    values = [r[key] for r in records if isinstance(r.get(key), (int, float))]
    return statistics.median(values) if values else None


def replay(args) -> dict:
    scenarios = {
        "one_step": ["schedule.mode=one_step"],
        "bf16 autocast": ["trainer.autocast=bfloat16"],
    }
    quick = [
        f"trainer.total_steps={args.steps}",
        "trainer.val_every=0",
        "trainer.val_at_start=false",
        "trainer.ppo_epochs=2",
        "checkpoint.every=0",
    ]
    rows = []
    for scenario, overrides in scenarios.items():
        for mode in ("off", "R2", "R3"):
            steps, _, wall = train(quick + overrides + [f"algorithm.routing_replay={mode}"])
            row = {
                "scenario": scenario,
                "routing_replay": mode,
                "steps": len(steps),
                "router_match": median(steps, "moe/rollout_router_match"),
                "mismatch_kl": median(steps, "rollout_mismatch/kl"),
                "ppo_kl": median(steps, "actor/ppo_kl"),
                "clipfrac": median(steps, "actor/pg_clipfrac"),
                "wall_s": round(wall, 1),
            }
            rows.append(row)
            print(row, flush=True)
    lines = [
        "| scenario | routing_replay | steps | moe/rollout_router_match | rollout_mismatch/kl "
        "| actor/ppo_kl | actor/pg_clipfrac |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['scenario']} | {r['routing_replay']} | {r['steps']} | {r['router_match']:.4f} "
        f"| {r['mismatch_kl']:.2e} | {r['ppo_kl']:.2e} | {r['clipfrac']:.4f} |"
        for r in rows
    ]
    return {"rows": rows, "table": lines}


def learn(args) -> dict:
    rows = []
    for loss in ("ppo_clip", "gspo"):
        for mode in ("off", "R3"):
            overrides = [f"algorithm.policy_loss={loss}", f"algorithm.routing_replay={mode}"]
            if args.steps:
                overrides.append(f"trainer.total_steps={args.steps}")
            _, summary, wall = train(overrides)
            row = {
                "policy_loss": loss,
                "routing_replay": mode,
                "val_accuracy_start": summary["val_accuracy_start"],
                "val_accuracy_end": summary["val_accuracy_end"],
                "gain_points": round(
                    100 * (summary["val_accuracy_end"] - summary["val_accuracy_start"]), 1
                ),
                "train_s": round(summary["seconds"], 1),
                "wall_s": round(wall, 1),
            }
            rows.append(row)
            print(row, flush=True)
    lines = [
        "| policy loss | routing_replay | val/accuracy start → end | gain | training s |",
        "|---|---|---|---:|---:|",
    ]
    lines += [
        f"| {r['policy_loss']} | {r['routing_replay']} | {r['val_accuracy_start']:.3f} → "
        f"{r['val_accuracy_end']:.3f} | {r['gain_points']:+.1f} | {r['train_s']:.0f} |"
        for r in rows
    ]
    return {"rows": rows, "table": lines}


def speed(args) -> dict:
    quick = [
        f"trainer.total_steps={args.steps}",
        "trainer.val_every=0",
        "trainer.val_at_start=false",
        "checkpoint.every=0",
    ]
    paths = {
        "lean paths": ["rollout.fast_decode=true", "trainer.packed_forward=true"],
        "model's own forward": ["rollout.fast_decode=false", "trainer.packed_forward=false"],
    }
    samples: dict[str, dict[str, list[float]]] = {
        name: {"gen": [], "update": [], "step": []} for name in paths
    }
    for _ in range(args.rounds):  # alternating, so drift affects both alike
        for name, overrides in paths.items():
            steps, _, _ = train(quick + overrides)
            for key in ("gen", "update", "step"):
                samples[name][key] += [r[f"timing_s/{key}"] for r in steps[1:]]
    medians = {
        name: {key: statistics.median(values) for key, values in parts.items()}
        for name, parts in samples.items()
    }
    lean, own = medians["lean paths"], medians["model's own forward"]
    lines = ["| path | generation s | update s | step s |", "|---|---:|---:|---:|"]
    lines += [
        f"| {name} | {m['gen']:.3f} | {m['update']:.3f} | {m['step']:.3f} |"
        for name, m in medians.items()
    ]
    lines.append(
        f"| ratio (own / lean) | {own['gen'] / lean['gen']:.2f} | "
        f"{own['update'] / lean['update']:.2f} | {own['step'] / lean['step']:.2f} |"
    )
    return {"medians": medians, "table": lines}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=("replay", "learn", "speed"))
    parser.add_argument("--steps", type=int, default=0, help="steps per run (0: command default)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    args.steps = args.steps or {"replay": 24, "learn": 0, "speed": 12}[args.command]
    started = time.perf_counter()
    result = {"replay": replay, "learn": learn, "speed": speed}[args.command](args)
    result |= {
        "command": f"python -m benchmarks.moe {args.command} --steps {args.steps}"
        + (f" --rounds {args.rounds}" if args.command == "speed" else ""),
        "config": CONFIG,
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}, 2 cores",
        "seconds": round(time.perf_counter() - started, 1),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = f"moe_{args.command}"
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=1))
    header = f"`{result['command']}` on {result['machine']} ({CONFIG}, one seed)\n\n"
    (RESULTS / f"{name}.md").write_text(header + "\n".join(result["table"]) + "\n")
    print("\n".join(result["table"]))


if __name__ == "__main__":
    main()
