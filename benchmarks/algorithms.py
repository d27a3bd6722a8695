"""Each advantage estimator x policy loss on the same budget: the demo's task and model.

Runs `honing train examples/arithmetic.yaml` once per combination with the same seed and
trainer.total_steps (default 200), and writes a table of final greedy validation accuracy,
wall time and tokens to benchmarks/results/algorithms.{json,md}. Run it alone on the machine:
the accuracies are deterministic, the times are not when something else competes for the CPU.

    .venv/bin/python benchmarks/algorithms.py --steps 200
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

ESTIMATORS = ["grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline", "reinforce_plus_plus"]
LOSSES = {
    "ppo_clip": [],
    # GSPO's sequence-level ratio needs the paper's small clip range (arXiv 2507.18071).
    "gspo": ["algorithm.clip_ratio_low=3e-4", "algorithm.clip_ratio_high=4e-4"],
    "cispo": ["algorithm.clip_ratio_low=1.0", "algorithm.clip_ratio_high=0.28"],
}


def run(estimator: str, loss: str, steps: int, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as workdir:
        run_dir = Path(workdir) / "run"
        args = [
            f"algorithm.advantage={estimator}",
            f"algorithm.policy_loss={loss}",
            f"trainer.total_steps={steps}",
            f"trainer.val_every={steps}",
            "monitor.console=false",
            "checkpoint.every=0",
            *LOSSES[loss],
            *extra,
        ]
        started = time.perf_counter()
        subprocess.run(
            [
                sys.executable,
                "-m",
                "honing.cli",
                "train",
                "examples/arithmetic.yaml",
                *args,
                "--output-dir",
                str(run_dir),
                "--resume",
                "never",
            ],
            check=True,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
        )
        wall = time.perf_counter() - started
        summary = json.loads((run_dir / "summary.json").read_text())
        metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    tokens = sum(m.get("perf/throughput", 0) * m.get("timing_s/step", 0) for m in metrics)
    return {
        "advantage": estimator,
        "policy_loss": loss,
        "overrides": LOSSES[loss] + extra,
        "val_accuracy_start": summary["val_accuracy_start"],
        "val_accuracy_end": summary["val_accuracy_end"],
        "train_seconds": summary["seconds"],
        "wall_seconds": round(wall, 1),
        "tokens": round(tokens),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--estimators", nargs="*", default=ESTIMATORS)
    parser.add_argument("--losses", nargs="*", default=list(LOSSES))
    parser.add_argument("--extra", nargs="*", default=[], help="more section.key=value overrides")
    parser.add_argument("--name", default="algorithms", help="results file stem")
    args = parser.parse_args()
    rows = []
    for estimator in args.estimators:
        for loss in args.losses:
            rows.append(run(estimator, loss, args.steps, args.extra))
            r = rows[-1]
            print(
                f"{estimator:30s} {loss:9s} {r['val_accuracy_start']:.3f} -> "
                f"{r['val_accuracy_end']:.3f}  {r['train_seconds']:.0f} s",
                flush=True,
            )
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(
        json.dumps({"steps": args.steps, "extra": args.extra, "rows": rows}, indent=1)
    )
    lines = [
        f"Budget: {args.steps} steps of examples/arithmetic.yaml (16 prompts x 8), seed 0, "
        f"2-core CPU; overrides: {' '.join(args.extra) or 'none'}.",
        "",
        "| advantage | policy_loss | val acc start | val acc end | train s | tokens |",
        "|---|---|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['advantage']} | {r['policy_loss']} | {r['val_accuracy_start']:.3f} | "
        f"{r['val_accuracy_end']:.3f} | {r['train_seconds']:.0f} | {r['tokens']} |"
        for r in rows
    ]
    (RESULTS / f"{args.name}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
