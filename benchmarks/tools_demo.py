"""The tool demo, measured: held-out accuracy and the calculator's call rate before and after
GRPO, with tools and without (the same model answering itself), the model's build time and
the training time, under each CPU kernel path this machine can take.

For each kernel path (benchmarks/demo_kernels.py's PATHS: native, AVX2, no SIMD), with an
empty model cache: builds builtin:tiny-tools (timed apart), then runs `honing train
examples/arithmetic_tools.yaml` (tools) and the same with `rollout.tools=[]` (no tools) into
fresh directories, and writes benchmarks/results/tools_demo.json and .md. Run it alone:

    .venv/bin/python -m benchmarks.tools_demo [--paths native,avx2] [--seeds 1] [--tools-only]
        [override ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.demo_kernels import PATHS
from benchmarks.moe import cpu_model

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
CONFIG = "examples/arithmetic_tools.yaml"
ARMS = {"tools": [], "no tools": ["rollout.tools=[]"]}
KEYS = ("val/accuracy", "val/pass@2", "val/tool_calls_per_sample", "val/tool_errors")
BUILD = (
    "from honing.config import build_config; "
    "from honing.pipeline.components import resolve_model_path; "
    "resolve_model_path(build_config({'model.path': 'builtin:tiny-tools'}))"
)


def build_model(env: dict[str, str]) -> float:
    """Seconds to build builtin:tiny-tools into ``env``'s (empty) model cache."""
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", BUILD], check=True, cwd=ROOT, env=env)
    return time.perf_counter() - started


def train(overrides: list[str], workdir: Path, env: dict[str, str]) -> dict:
    """One `honing train` of the demo config; its summary, step times and metric rows."""
    run_dir = workdir / "run"
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "honing.cli", "train", CONFIG, *overrides]
        + ["--output-dir", str(run_dir), "--resume", "never", "monitor.console=false"],
        check=True,
        cwd=ROOT,
        env=env,
    )
    wall = time.perf_counter() - started
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step_times = sorted(m["timing_s/step"] for m in rows if "timing_s/step" in m)
    return {
        "wall_s": round(wall, 1),
        "summary": json.loads((run_dir / "summary.json").read_text()),
        "median_step_s": step_times[len(step_times) // 2],
        "val": [
            {"step": m["step"]} | {k: m[k] for k in KEYS if k in m} for m in rows if KEYS[0] in m
        ],
        "train": [
            {
                "step": m["step"],
                "score": round(m["critic/score/mean"], 3),
                "calls_per_sample": round(m["tool/calls_per_sample"], 3),
                "errors": m["tool/errors"],
            }
            for m in rows
            if "tool/calls_per_sample" in m and "critic/score/mean" in m
        ],
    }


def run_path(kernels: dict[str, str], arms: dict, seeds: int, overrides: list[str]) -> dict:
    """Build the model and run every arm and seed under ``kernels``, with a fresh cache."""
    with tempfile.TemporaryDirectory(prefix="honing-tools-demo-") as scratch:
        env = os.environ | kernels | {"HONING_CACHE": str(Path(scratch) / "cache")}
        build_s = build_model(env)
        print(f"builtin:tiny-tools built in {build_s:.0f} s", flush=True)
        runs: dict[str, dict[int, dict]] = {arm: {} for arm in arms}
        for seed in range(seeds):
            for arm, arm_overrides in arms.items():
                load = os.getloadavg()[0]
                with tempfile.TemporaryDirectory(dir=scratch) as workdir:
                    argv = [*overrides, *arm_overrides, f"trainer.seed={seed}"]
                    run = train(argv, Path(workdir), env)
                run["load_average"] = [round(load, 2), round(os.getloadavg()[0], 2)]
                runs[arm][seed] = run
                print(f"{arm}, seed {seed}: {json.dumps(run['val'])}", flush=True)
    return {"kernels": kernels, "model_build_s": round(build_s, 1), "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--paths", default=",".join(PATHS), help="kernel paths, comma-separated")
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--tools-only", action="store_true", help="skip the no-tools arm")
    parser.add_argument("--render", action="store_true", help="rewrite the .md from the .json")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.render:
        write_markdown(json.loads((RESULTS / "tools_demo.json").read_text()))
        return
    arms = {"tools": ARMS["tools"]} if args.tools_only else ARMS
    paths: dict[str, dict] = {}
    for name in args.paths.split(","):
        paths[name] = run_path(PATHS[name], arms, args.seeds, args.overrides)
        write_record(args, paths)  # each path's figures kept as soon as it ends


def write_record(args: argparse.Namespace, paths: dict) -> None:
    command = " ".join(
        ["python -m benchmarks.tools_demo", f"--paths {args.paths}", f"--seeds {args.seeds}"]
        + (["--tools-only"] if args.tools_only else [])
        + args.overrides
    )
    import torch

    machine = (
        f"{cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__} "
        f"(native kernels: {torch.backends.cpu.get_cpu_capability()})"
    )
    RESULTS.mkdir(parents=True, exist_ok=True)
    record = {"command": command, "machine": machine, "paths": paths}
    (RESULTS / "tools_demo.json").write_text(json.dumps(record, indent=1))
    write_markdown(record)


def table(paths: dict) -> list[str]:
    lines = [
        "| kernels | arm | seed | build s | val/accuracy start → end | val/pass@2 start → end "
        "| tool calls per val sample start → end | training s | all s "
        "| load average before, after |",
        "|---|---|---:|---:|---|---|---|---:|---:|---|",
    ]
    for name, path in paths.items():
        for arm, runs in path["runs"].items():
            for seed, run in runs.items():
                first, last = run["val"][0], run["val"][-1]

                def span(key: str, first=first, last=last) -> str:
                    return f"{first[key]:.3f} → {last[key]:.3f}" if key in first else "no tools"

                lines.append(
                    f"| {name} | {arm} | {seed} | {path['model_build_s']:.0f} "
                    f"| {span('val/accuracy')} | {span('val/pass@2')} "
                    f"| {span('val/tool_calls_per_sample')} | {run['summary']['seconds']:.0f} "
                    f"| {run['wall_s']:.0f} | {run['load_average']} |"
                )
    return lines


def write_markdown(record: dict) -> None:
    paths = record["paths"]
    environments = [
        f"{name}: `{' '.join(f'{k}={v}' for k, v in path['kernels'].items()) or '(none)'}`"
        for name, path in paths.items()
    ]
    curves = []
    for name, path in paths.items():
        for arm, runs in path["runs"].items():
            for seed, run in runs.items():
                curves += [f"\n{name}, {arm}, seed {seed}:\n"]
                curves.append("| step | " + " | ".join(KEYS) + " |")
                curves.append("|---:|" + "---:|" * len(KEYS))
                for point in run["val"]:
                    values = " | ".join(f"{point[k]:.3f}" if k in point else "-" for k in KEYS)
                    curves.append(f"| {point['step']} | {values} |")
    (RESULTS / "tools_demo.md").write_text(
        f"# The tool demo on each CPU kernel path\n\n"
        f"Command: `{record['command']}`; machine: {record['machine']}. Each kernel path builds "
        f"builtin:tiny-tools from an empty model cache (build s), then trains {CONFIG} "
        f"(no tools: `rollout.tools=[]`). Kernel paths: {'; '.join(environments)}.\n\n"
        + "\n".join(table(paths) + curves)
        + (f"\n\n{record['note']}\n" if record.get("note") else "\n")
    )


if __name__ == "__main__":
    main()
