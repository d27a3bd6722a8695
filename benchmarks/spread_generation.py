"""Data-parallel generation: does spreading the batch's sampling over the torchrun ranks pay?

The grpo_step benchmark's 10M-parameter model at 128 new tokens (8 prompts x 8 completions,
no reference model), three ways, alternating, ``--rounds`` times:
- ``one``: one process with both cores' threads (``trainer.threads=2``);
- ``rank0``: ``torchrun --nproc_per_node 2``, one thread a rank, rank 0 samples the whole batch
  (``pipeline.spread_generation=false``) and both ranks share the update;
- ``spread``: the same two ranks, each sampling half the batch's tasks
  (``pipeline.rollout_chunk=4``: two tasks of four prompts, one a rank).

Per run: medians over the steps after the first of ``timing_s/gen``, ``timing_s/update`` and
``timing_s/step`` from metrics.jsonl. Reported: the medians over rounds.

    .venv/bin/python -m benchmarks.spread_generation [--rounds 2] [--steps 6]

writes benchmarks/results/spread_generation.{json,md}. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.grpo_step import M10, RESULTS, SEED, WORK, Workload, honing_overrides, revision
from benchmarks.grpo_workloads import alternating, build_model_dir, peer_data

WORKLOAD = Workload("m10_t128", M10, 128, 0.0, 1, 1)
VARIANTS = {
    "one": (1, 2, []),
    "rank0": (2, 1, ["pipeline.spread_generation=false"]),
    "spread": (2, 1, ["pipeline.rollout_chunk=4"]),
}
STAGES = ("gen", "update", "step")


def run(name: str, steps: int, model_dir: Path, data: dict, out: Path) -> dict:
    """One run of variant ``name``; its per-stage medians (the first step left out)."""
    ranks, threads, extra = VARIANTS[name]
    work = Workload(WORKLOAD.name, M10, WORKLOAD.max_new_tokens, 0.0, steps, 1)
    command = [sys.executable]
    if ranks > 1:
        command += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]
    command += ["-m", "honing.cli", "train", *honing_overrides(work, model_dir, data, threads)]
    command += [*extra, "--output-dir", str(out), "--resume", "never"]
    subprocess.run(["rm", "-rf", str(out)], check=True)
    log = out.with_suffix(".log")
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as sink:
        subprocess.run(command, stdout=sink, stderr=subprocess.STDOUT, check=True)
    lines = (out / "metrics.jsonl").read_text().splitlines()
    metrics = [m for m in map(json.loads, lines) if m.get("step", 0) >= 2 and "timing_s/gen" in m]
    result = {s: statistics.median(m[f"timing_s/{s}"] for m in metrics) for s in STAGES}
    result["generation_ranks"] = metrics[0].get("rollout/generation_ranks", 1.0)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args(argv)
    model_dir = WORK / "models" / M10.name
    build_model_dir(M10, model_dir, SEED)
    data = peer_data(WORK, SEED)
    code, started = revision(), time.time()
    runs: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    for round_index, name in alternating(args.rounds, VARIANTS):
        out = WORK / "runs" / "spread_generation" / f"{round_index}_{name}"
        runs[name].append(run(name, args.steps, model_dir, data, out))
        figures = ", ".join(f"{s} {runs[name][-1][s]:.3f} s" for s in STAGES)
        print(f"round {round_index} {name:6s}: {figures}", flush=True)
    medians = {
        name: {s: statistics.median(r[s] for r in results) for s in STAGES}
        for name, results in runs.items()
    }
    report = {
        "revision": code,
        "command": "python -m benchmarks.spread_generation " + " ".join(argv or sys.argv[1:]),
        "wall_s": round(time.time() - started, 1),
        "workload": "10M-parameter Qwen2, 8 prompts x 8 completions, 128 new tokens, no KL",
        "runs": runs,
        "medians": medians,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "spread_generation.json").write_text(json.dumps(report, indent=1))
    (RESULTS / "spread_generation.md").write_text(markdown(report))
    print(markdown(report))


def markdown(report: dict) -> str:
    medians = report["medians"]
    rows = [
        f"| {name} | {m['gen']:.3f} | {m['update']:.3f} | {m['step']:.3f} | "
        f"{medians['one']['gen'] / m['gen']:.2f}x | {medians['one']['step'] / m['step']:.2f}x |"
        for name, m in medians.items()
    ]
    return "\n".join(
        [
            "# Data-parallel generation (`pipeline.spread_generation`)",
            "",
            f"{report['workload']}; 2-core CPU; revision {report['revision']}; "
            f"`{report['command'].strip()}` ({report['wall_s']} s). Medians over rounds of "
            "each run's median stage time (first step left out); speed-ups against `one`.",
            "",
            "| variant | gen s | update s | step s | gen speed-up | step speed-up |",
            "|---|---|---|---|---|---|",
            *rows,
            "",
            "`one`: one process, 2 threads. `rank0`: 2 torchrun ranks of 1 thread, rank 0 "
            "samples the whole batch. `spread`: the same ranks, each sampling half the tasks.",
            "",
            f"Spreading against rank 0 sampling alone: generation "
            f"{medians['rank0']['gen'] / medians['spread']['gen']:.2f}x as fast, the step "
            f"{medians['rank0']['step'] / medians['spread']['step']:.2f}x.",
            "",
        ]
    )


if __name__ == "__main__":
    main()
