"""The demo's learning curve, measured: validation accuracy against wall-clock time.

Runs `honing train examples/arithmetic.yaml` (the config `make demo` runs) --runs times with
the same seed into fresh directories, checks that the curves are identical (determinism on
CPU), and writes benchmarks/results/demo_curve.json and .md.

    .venv/bin/python benchmarks/demo_curve.py --runs 2
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def run_once(config: str, overrides: list[str], workdir: Path) -> dict:
    run_dir = workdir / "run"
    started = time.perf_counter()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "honing.cli",
            "train",
            config,
            *overrides,
            "--output-dir",
            str(run_dir),
            "--resume",
            "never",
            "monitor.console=false",
        ],
        check=True,
        cwd=ROOT,
    )
    wall = time.perf_counter() - started
    summary = json.loads((run_dir / "summary.json").read_text())
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step_times = [m["timing_s/step"] for m in metrics if "timing_s/step" in m]
    return {
        "wall_s": wall,
        "summary": summary,
        "median_step_s": sorted(step_times)[len(step_times) // 2],
        "scores": [m.get("critic/score/mean") for m in metrics],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--config", default="examples/arithmetic.yaml")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    runs = []
    for index in range(args.runs):
        with tempfile.TemporaryDirectory() as workdir:
            runs.append(run_once(args.config, args.overrides, Path(workdir)))
        s = runs[-1]["summary"]
        print(
            f"run {index + 1}: val/accuracy {s['val_accuracy_start']:.3f} -> "
            f"{s['val_accuracy_end']:.3f} in {s['seconds']:.0f} s of training "
            f"({runs[-1]['wall_s']:.0f} s wall)",
            flush=True,
        )
    identical = all(r["scores"] == runs[0]["scores"] for r in runs)
    result = {
        "config": args.config,
        "overrides": args.overrides,
        "machine": platform.processor() or platform.machine(),
        "runs": runs,
        "same_seed_identical_scores": identical,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "demo_curve.json").write_text(json.dumps(result, indent=1))
    first = runs[0]["summary"]
    lines = ["| step | seconds | val/accuracy |", "|---:|---:|---:|"]
    lines += [f"| {p['step']} | {p['seconds']} | {p['val/accuracy']:.3f} |" for p in first["curve"]]
    (RESULTS / "demo_curve.md").write_text(
        f"Demo curve ({args.config}, {len(runs)} run(s), identical with the same seed: "
        f"{identical}); warm start {first['pass_at_k_key']} = {first['pass_at_k_start']:.3f}\n\n"
        + "\n".join(lines)
        + "\n"
    )
    print(f"same seed, identical per-step scores: {identical}")


if __name__ == "__main__":
    main()
