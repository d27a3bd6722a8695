"""The cost of mirroring checkpoints to S3 in the background, and resuming from the mirror.

The demo (examples/arithmetic.yaml: GRPO on the built-in tiny model) runs ``--steps`` steps
with a checkpoint every ``--every`` steps (kept locally, ``checkpoint.keep=2``), once without
a mirror and once with ``checkpoint.mirror_url=s3://...`` on a real S3 API (moto's server on
loopback, reached through the AWS environment variables), alternating, ``--rounds`` times.
Reported: training time (the sum of the steps' ``timing_s/step``), the median step, and the
mean of the steps during which an upload ran, with the uploads' seconds and bytes.

Then the resume: a mirrored run of half the steps, its run directory deleted, the same
command with ``--resume auto`` fetches the newest copy from S3 and trains to the end; its
final weights are compared with an uninterrupted run's.

    .venv/bin/python -m benchmarks.mirror --steps 100 --every 10 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from benchmarks.grpo_workloads import alternating
from tests.s3_server import s3_server

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
CONFIG = "examples/arithmetic.yaml"


def train(run_dir: Path, steps: int, every: int, mirror: str, env: dict, resume="never"):
    command = [sys.executable, "-m", "honing.cli", "train", CONFIG]
    command += [
        f"trainer.total_steps={steps}",
        "trainer.val_every=0",
        "trainer.val_at_start=false",
        f"checkpoint.every={every}",
        "checkpoint.keep=2",
        "monitor.console=false",
        "monitor.tensorboard=false",
        "--output-dir",
        str(run_dir),
        "--resume",
        resume,
    ]
    if mirror:
        command.append(f"checkpoint.mirror_url={mirror}")
    subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, env=env)


def read(run_dir: Path) -> tuple[list[dict], list[dict]]:
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    return sorted((m for m in metrics if m["step"] >= 1), key=lambda m: m["step"]), events


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(variant: str, run_dir: Path, args, env: dict, bucket: str, server) -> dict:
    mirror = f"s3://{bucket}/{run_dir.name}" if variant == "s3" else ""
    server_cpu = cpu_seconds(server.process.pid)
    started = time.perf_counter()
    train(run_dir, args.steps, args.every, mirror, env)
    wall = time.perf_counter() - started
    server_cpu = cpu_seconds(server.process.pid) - server_cpu
    steps, events = read(run_dir)
    uploads = [e for e in events if e["kind"] == "checkpoint_mirrored"]
    # a step ran during an upload if it started after the save and before the upload ended
    busy = {
        m["step"]
        for u in uploads
        for m in steps
        if m["step"] > u["step"] and m["time"] - m["timing_s/step"] < u["time"]
    }
    during = [m["timing_s/step"] for m in steps if m["step"] in busy]
    return {
        "variant": variant,
        "wall_s": wall,
        "train_s": sum(m["timing_s/step"] for m in steps),
        "step_median_s": statistics.median(m["timing_s/step"] for m in steps),
        "steps_during_uploads": len(during),
        "step_mean_during_uploads_s": statistics.mean(during) if during else None,
        "uploads": len(uploads),
        "upload_s": [u["seconds"] for u in uploads],
        "upload_mb": [u["bytes"] / 2**20 for u in uploads],
        "failures": sum(e["kind"] == "mirror_failed" for e in events),
        "server_cpu_s": server_cpu,  # the S3 server's work, on the same cores here
    }


def resume_check(workdir: Path, args, env: dict, bucket: str) -> dict:
    whole, lost = workdir / "whole", workdir / "lost"
    train(whole, args.steps, args.every, "", env)
    mirror = f"s3://{bucket}/lost"
    train(lost, args.steps // 2, args.every, mirror, env)
    shutil.rmtree(lost)  # a new machine: only the mirror is left
    started = time.perf_counter()
    train(lost, args.steps, args.every, mirror, env, resume="auto")
    resumed_s = time.perf_counter() - started
    _, events = read(lost)
    fetched = [e for e in events if e["kind"] == "checkpoint_from_mirror"]
    final = f"checkpoints/step_{args.steps}/model.safetensors"
    want, got = load_file(whole / final), load_file(lost / final)
    differ = max((got[k] - want[k]).abs().max().item() for k in want)
    return {
        "resumed_from_step": fetched[0]["step"] if fetched else None,
        "resumed_run_s": resumed_s,
        "max_abs_weight_difference": differ,
        "identical": all(torch.equal(got[k], want[k]) for k in want),
    }


def write_markdown(result: dict, path: Path) -> None:
    by = {v: [r for r in result["runs"] if r["variant"] == v] for v in ("none", "s3")}
    base = statistics.median(r["train_s"] for r in by["none"])
    lines = [
        "# Checkpoints mirrored to S3 in the background",
        "",
        f"Command: `{result['command']}`, {result['minutes']:.1f} min in all.",
        "",
        f"Machine: {result['machine']}. Workload: the demo (`{CONFIG}`) for {result['steps']} "
        f"steps, a checkpoint every {result['every']} steps (kept locally, 2 of them), without "
        "a mirror and with `checkpoint.mirror_url=s3://...` on moto's S3 server on loopback "
        f"(s3fs), alternating, {result['rounds']} rounds. Training time: the sum of the steps' "
        "`timing_s/step` (saves happen between steps, in both variants). Medians over rounds. "
        "The S3 server runs on the same two cores as training (its CPU time is the last "
        "column); a remote store's work would not.",
        "",
        "| mirror | training s | vs none | median step s | mean step s while uploading "
        "| uploads | upload s (median) | MB each | S3 server CPU s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for variant, runs in by.items():
        train_s = statistics.median(r["train_s"] for r in runs)
        during = [r["step_mean_during_uploads_s"] for r in runs if r["step_mean_during_uploads_s"]]
        seconds = [s for r in runs for s in r["upload_s"]]
        sizes = [s for r in runs for s in r["upload_mb"]]
        median_step = statistics.median(r["step_median_s"] for r in runs)
        cells = [
            variant,
            f"{train_s:.2f}",
            f"{train_s / base:.3f}×",
            f"{median_step:.3f}",
            f"{statistics.median(during):.3f}" if during else "–",
            f"{statistics.median(r['uploads'] for r in runs):.0f}",
            f"{statistics.median(seconds):.3f}" if seconds else "–",
            f"{statistics.median(sizes):.1f}" if sizes else "–",
            f"{statistics.median(r['server_cpu_s'] for r in runs):.2f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    resume = result["resume"]
    lines += [
        "",
        f"Resume from the mirror: a mirrored run of {result['steps'] // 2} steps, its run "
        f"directory deleted, then `--resume auto` to step {result['steps']}: fetched the copy "
        f"of step {resume['resumed_from_step']} from S3 (manifest verified), "
        f"{resume['resumed_run_s']:.1f} s for that run; final weights "
        + (
            "bit-identical to an uninterrupted run's."
            if resume["identical"]
            else f"within {resume['max_abs_weight_difference']:.2e} of an uninterrupted run's."
        ),
    ]
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=str(RESULTS / "mirror.json"))
    args = parser.parse_args()
    started = time.perf_counter()
    bucket = "honing-bench"
    runs = []
    with s3_server() as server, tempfile.TemporaryDirectory() as tmp:
        env = os.environ | server.env
        train(Path(tmp) / "warm", 1, 0, "", env)  # builds builtin:tiny once, outside the timing
        for index, variant in alternating(args.rounds, ["none", "s3"]):
            run = measure(variant, Path(tmp) / f"{variant}-{index}", args, env, bucket, server)
            runs.append(run)
            print(json.dumps(run), flush=True)
        resume = resume_check(Path(tmp), args, env, bucket)
        print(json.dumps(resume), flush=True)
    result = {
        "command": "python -m benchmarks.mirror " + " ".join(sys.argv[1:]),
        "machine": f"{os.cpu_count()}-core {platform.machine()} CPU VM, torch {torch.__version__}",
        "steps": args.steps,
        "every": args.every,
        "rounds": args.rounds,
        "runs": runs,
        "resume": resume,
        "minutes": (time.perf_counter() - started) / 60,
    }
    out = Path(args.out)
    out.write_text(json.dumps(result, indent=1))
    write_markdown(result, out.with_suffix(".md"))


if __name__ == "__main__":
    main()
