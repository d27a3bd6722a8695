"""sync against one_step / async schedules when scoring has real latency.

The demo (examples/arithmetic.yaml: GRPO, built-in tiny model, 16 prompts x 8 samples) scored
by a real verifier service on loopback (``honing serve verifier --delay-ms D``: every request
is held D ms, the latency of a remote judge or a loaded verifier pool), for ``--steps`` steps
with validation every 25. Each schedule runs ``--pairs`` times, alternating the order.

Measured per run: training time (first step's start to the last step's end, less the
validation passes, which are the same work in every schedule), seconds per step, trainer and
engine idle time, staleness, and the learning curve (validation accuracy against trained
samples). Writes benchmarks/results/schedule.{json,md}.

    .venv/bin/python -m benchmarks.schedule [--steps 150] [--delay-ms 400] [--pairs 1]
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

import torch

from honing.services.process import start_service

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
CONFIG = "examples/arithmetic.yaml"
MODES = {
    "sync": ["schedule.mode=sync"],
    "one_step": ["schedule.mode=one_step"],
    "async": ["schedule.mode=async", "schedule.max_staleness=1"],
}


def run_once(mode: str, url: str, steps: int, workdir: Path) -> dict:
    run_dir = workdir / mode
    command = [sys.executable, "-m", "honing.cli", "train", CONFIG, *MODES[mode]]
    command += [
        f"reward.endpoint={url}",
        f"trainer.total_steps={steps}",
        "checkpoint.every=0",
        "monitor.console=false",
        "monitor.tensorboard=false",
        "--output-dir",
        str(run_dir),
        "--resume",
        "never",
    ]
    started = time.perf_counter()
    subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - started
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    metrics = sorted(map(json.loads, lines), key=lambda m: m["step"])
    trained = [m for m in metrics if m["step"] >= 1]
    first = trained[0]
    started_s = first["time"] - first["timing_s/step"] - first.get("timing_s/val", 0.0)
    train_s = trained[-1]["time"] - started_s - sum(m.get("timing_s/val", 0.0) for m in trained)
    samples, curve = 0, []
    for m in metrics:
        samples += m.get("samples/trained", 0)
        if "val/accuracy" in m:
            curve.append({"step": m["step"], "samples": samples, "accuracy": m["val/accuracy"]})
    return {
        "mode": mode,
        "wall_s": wall,
        "train_s": train_s,
        "step_s": statistics.median(m["timing_s/step"] for m in trained),
        "trainer_idle_s": statistics.median(m.get("timing_s/trainer_idle", 0.0) for m in trained),
        "gen_s": statistics.median(m["timing_s/gen"] for m in trained),
        "reward_s": statistics.median(m["timing_s/reward"] for m in trained),
        "update_s": statistics.median(m.get("timing_s/update", 0.0) for m in trained),
        "max_staleness_seen": max(m.get("async/staleness", 0) for m in trained),
        "samples_trained": samples,
        "samples_stale": sum(m.get("samples/stale", 0) for m in trained),
        "curve": curve,
    }


def write_markdown(result: dict, path: Path) -> None:
    by_mode: dict[str, list[dict]] = {}
    for run in result["runs"]:
        by_mode.setdefault(run["mode"], []).append(run)
    sync_s = statistics.median(r["train_s"] for r in by_mode["sync"])
    lines = [
        "# Schedules when scoring has latency: sync vs one_step vs async",
        "",
        f"Command: `{result['command']}`, {result['minutes']:.1f} min in all.",
        "",
        f"Machine: {result['machine']}. Workload: the demo (`{CONFIG}`: GRPO, built-in tiny "
        f"model, 16 prompts x 8 samples, 4 new tokens) for {result['steps']} steps, scored by "
        f"`honing serve verifier --delay-ms {result['delay_ms']:.0f}` on loopback (one request "
        "per step's batch, held that long). Training time: first step's start to the last "
        "step's end, less the validation passes. Medians over runs.",
        "",
        "| schedule | runs | training s | speed-up vs sync | s/step | gen s | reward s | "
        "update s | trainer idle s/step | max staleness | trained samples | stale |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, runs in by_mode.items():

        def med(key: str, runs: list[dict] = runs) -> float:
            return statistics.median(r[key] for r in runs)

        lines.append(
            f"| {mode} | {len(runs)} | {med('train_s'):.1f} | **{sync_s / med('train_s'):.2f}×** "
            f"| {med('step_s'):.3f} | {med('gen_s'):.3f} | {med('reward_s'):.3f} | "
            f"{med('update_s'):.3f} | {med('trainer_idle_s'):.3f} | "
            f"{max(r['max_staleness_seen'] for r in runs):.0f} | {med('samples_trained'):.0f} | "
            f"{sum(r['samples_stale'] for r in runs)} |"
        )
    lines += ["", "## Learning curve (validation accuracy by trained samples, first runs)", ""]
    modes = list(by_mode)
    lines += ["| step | samples | " + " | ".join(modes) + " |", "|---" * (len(modes) + 2) + "|"]
    curves = {mode: runs[0]["curve"] for mode, runs in by_mode.items()}
    for index, point in enumerate(curves[modes[0]]):
        values = [
            f"{curves[m][index]['accuracy']:.3f}" if index < len(curves[m]) else "–" for m in modes
        ]
        lines.append(f"| {point['step']} | {point['samples']} | " + " | ".join(values) + " |")
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--delay-ms", type=float, default=400.0)
    parser.add_argument("--pairs", type=int, default=1)
    parser.add_argument("--modes", default="sync,one_step,async")
    parser.add_argument("--tag", default="schedule")
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    started = time.perf_counter()
    process, url = start_service("verifier", "--delay-ms", str(args.delay_ms))
    runs = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for pair in range(args.pairs):
                order = modes if pair % 2 == 0 else modes[::-1]
                for mode in order:
                    run = run_once(mode, url, args.steps, Path(tmp) / f"{pair}")
                    runs.append(run)
                    print(
                        f"{mode:9s} pair {pair}: {run['train_s']:.1f} s training, "
                        f"{run['step_s']:.3f} s/step, final accuracy "
                        f"{run['curve'][-1]['accuracy']:.3f}",
                        flush=True,
                    )
    finally:
        process.terminate()
        process.wait()
    result = {
        "command": "python -m benchmarks.schedule " + " ".join(argv or sys.argv[1:]),
        "minutes": (time.perf_counter() - started) / 60,
        "machine": f"{torch.get_num_threads()} CPU threads, {platform.platform()}",
        "steps": args.steps,
        "delay_ms": args.delay_ms,
        "runs": runs,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.tag}.json").write_text(json.dumps(result, indent=1))
    write_markdown(result, RESULTS / f"{args.tag}.md")
    print((RESULTS / f"{args.tag}.md").read_text())


if __name__ == "__main__":
    main()
