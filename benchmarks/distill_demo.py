"""On-policy distillation against GRPO alone on the demo's task, over seeds.

A teacher is the demo's model trained by GRPO (``examples/arithmetic.yaml``, --teacher-steps
steps). Each student starts from the same warm start (``builtin:tiny``) and trains --steps
steps of 16 prompts x G samples (G in --group-sizes: the demo's 8, and 2, where a group's
two samples often score alike and give GRPO nothing) with each method, validated every
--every steps (greedy accuracy on the 200 held-out problems):

- ``grpo``: the verifier's reward alone (the demo);
- ``distill``: ``algorithm.advantage=distill``, each token's advantage the teacher's minus the
  student's logprob of the token the student sampled (no verifier);
- ``distill+score``: the same plus the verifier's GRPO advantage
  (``algorithm.distill_score_coef=1``).

Writes benchmarks/results/distill_demo.{json,md}.

    .venv/bin/python -m benchmarks.distill_demo [--seeds 0 1] [--steps 60] [--every 10]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.grpo_step import revision, save_results

ROOT = Path(__file__).resolve().parent.parent
CONFIG = "examples/arithmetic.yaml"
METHODS = {
    "grpo": [],
    "distill": ["algorithm.advantage=distill"],
    "distill+score": ["algorithm.advantage=distill", "algorithm.distill_score_coef=1.0"],
}


def train(run_dir: Path, *overrides: str) -> list[dict]:
    """``honing train`` of the demo's config with ``overrides``; its metrics lines."""
    command = [sys.executable, "-m", "honing.cli", "train", CONFIG, *overrides]
    command += ["--output-dir", str(run_dir), "--resume", "never", "monitor.console=false"]
    subprocess.run(command, check=True, cwd=ROOT, capture_output=True)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def curve(metrics: list[dict]) -> dict:
    """The validation points (step, val/accuracy, training seconds so far) and step time."""
    points, seconds = [], 0.0
    for m in metrics:
        seconds += m.get("timing_s/step", 0.0)
        if "val/accuracy" in m:
            points.append({"step": m["step"], "accuracy": m["val/accuracy"], "seconds": seconds})
    steps = [m["timing_s/step"] for m in metrics if "timing_s/step" in m]
    return {"points": points, "median_step_s": statistics.median(steps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--teacher-steps", type=int, default=200)
    parser.add_argument("--group-sizes", type=int, nargs="+", default=[8, 2])
    args = parser.parse_args()
    started, code = time.time(), revision()
    runs: dict = {}
    with tempfile.TemporaryDirectory() as work:
        teacher_dir = Path(work) / "teacher"
        steps = f"trainer.total_steps={args.teacher_steps}"
        teacher = curve(train(teacher_dir, steps, "trainer.val_every=100", "checkpoint.every=0"))
        teacher_path = teacher_dir / "checkpoints" / f"step_{args.teacher_steps}"
        print(f"teacher: {teacher['points'][-1]['accuracy']:.3f}", flush=True)
        for group, seed, (method, overrides) in itertools.product(
            args.group_sizes, args.seeds, METHODS.items()
        ):
            values = [f"trainer.total_steps={args.steps}", f"trainer.val_every={args.every}"]
            values += [f"trainer.seed={seed}", f"rollout.group_size={group}"]
            values += ["checkpoint.every=0", *overrides]
            if method != "grpo":
                values.append(f"algorithm.teacher_path={teacher_path}")
            run = curve(train(Path(work) / f"{method}-{group}-{seed}", *values))
            runs.setdefault(str(group), {}).setdefault(method, {})[str(seed)] = run
            last = run["points"][-1]
            print(f"16 x {group}, {method}, seed {seed}: {last['accuracy']:.3f}", flush=True)
    record = {"teacher": teacher, "runs": runs, "args": vars(args)}
    command = "python -m benchmarks.distill_demo " + " ".join(
        [f"--seeds {' '.join(map(str, args.seeds))}", f"--steps {args.steps}"]
        + [f"--every {args.every}", f"--teacher-steps {args.teacher_steps}"]
        + [f"--group-sizes {' '.join(map(str, args.group_sizes))}"]
    )
    save_results("distill_demo", record, report, command, started, code)


def report(record: dict) -> str:
    seeds = [str(seed) for seed in record["args"]["seeds"]]
    teacher = record["teacher"]["points"]
    lines = [
        "# On-policy distillation against GRPO alone (demo task)",
        "",
        f"Machine: {record['machine']}; revision {record['revision']}; `{record['command']}` "
        f"({record['wall_s']:.0f} s).",
        "",
        f"Teacher: the demo's model after {record['args']['teacher_steps']} GRPO steps, "
        f"greedy accuracy {teacher[0]['accuracy']:.3f} → {teacher[-1]['accuracy']:.3f}. "
        "Students: the same warm start, 16 prompts a step, lr 1e-4; greedy accuracy on the "
        "200 held-out problems. `distill`: each token's advantage is log pi_teacher - log "
        "pi_student of the token sampled; `distill+score`: plus the verifier's GRPO advantage.",
    ]
    for group, runs in record["runs"].items():
        methods = list(runs)
        lines += ["", f"### 16 prompts x {group} samples", ""]
        lines.append("| step | " + " | ".join(f"{m} (seed {s})" for m in methods for s in seeds))
        lines[-1] += " | " + " | ".join(f"{m} mean" for m in methods) + " |"
        lines.append("|---:|" + "---:|" * (len(methods) * (len(seeds) + 1)))
        first = runs[methods[0]][seeds[0]]["points"]
        for index, point in enumerate(first):
            cells = [runs[m][s]["points"][index]["accuracy"] for m in methods for s in seeds]
            means = [
                statistics.mean(runs[m][s]["points"][index]["accuracy"] for s in seeds)
                for m in methods
            ]
            row = " | ".join(f"{value:.3f}" for value in cells + means)
            lines.append(f"| {point['step']} | {row} |")
        lines += ["", "| method | median s / step |", "|---|---:|"]
        lines += [
            f"| {m} | {statistics.median(runs[m][s]['median_step_s'] for s in seeds):.3f} |"
            for m in methods
        ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
