"""The tool demo, measured: held-out accuracy and the calculator's call rate before and after
GRPO, with tools and without (the same model answering itself), and the training time.

Builds builtin:tiny-tools first (timed apart), then runs `honing train
examples/arithmetic_tools.yaml` (tools) and the same with `rollout.tools=[]` (no tools) into
fresh directories, and writes benchmarks/results/tools_demo.json and .md.

    .venv/bin/python benchmarks/tools_demo.py [--seeds 1] [override ...]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from demo_curve import run_once  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
CONFIG = "examples/arithmetic_tools.yaml"
ARMS = {"tools": [], "no tools": ["rollout.tools=[]"]}
KEYS = ("val/accuracy", "val/pass@2", "val/tool_calls_per_sample", "val/tool_errors")


def build_model() -> float:
    """Seconds to build (or find) builtin:tiny-tools in the model cache."""
    from honing.config import build_config
    from honing.pipeline.components import resolve_model_path

    started = time.perf_counter()
    resolve_model_path(build_config({"model.path": "builtin:tiny-tools"}))
    return time.perf_counter() - started


def val_points(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    return [
        {"step": m["step"]} | {k: m[k] for k in KEYS if k in m} for m in rows if "val/accuracy" in m
    ]


def train_rates(run_dir: Path) -> dict:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines if '"tool/calls_per_sample"' in line]
    return {"train_calls_per_sample": [round(m["tool/calls_per_sample"], 3) for m in rows]}


def run_arm(overrides: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as workdir:
        run = run_once(CONFIG, overrides, Path(workdir))
        run_dir = Path(workdir) / "run"
        run |= {"val": val_points(run_dir)} | train_rates(run_dir)
    run.pop("scores")
    return run


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def table(results: dict) -> list[str]:
    lines = [
        "| arm | seed | val/accuracy start → end | tool calls per val sample start → end "
        "| training s | median step s | load average before, after |",
        "|---|---:|---|---|---:|---:|---|",
    ]
    for arm, runs in results.items():
        for seed, run in runs.items():
            first, last = run["val"][0], run["val"][-1]
            key = "val/tool_calls_per_sample"
            calls = f"{first[key]:.3f} → {last[key]:.3f}" if key in first else "no tools"
            lines.append(
                f"| {arm} | {seed} | {first['val/accuracy']:.3f} → {last['val/accuracy']:.3f} "
                f"| {calls} | {run['summary']['seconds']:.0f} "
                f"| {run['median_step_s']:.2f} | {run['load_average']} |"
            )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--render", action="store_true", help="rewrite the .md from the .json")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.render:
        write_markdown(json.loads((RESULTS / "tools_demo.json").read_text()))
        return
    build_s = build_model()
    print(f"builtin:tiny-tools ready in {build_s:.0f} s", flush=True)
    results: dict[str, dict[int, dict]] = {arm: {} for arm in ARMS}
    for seed in range(args.seeds):
        for arm, arm_overrides in ARMS.items():
            overrides = [*args.overrides, *arm_overrides, f"trainer.seed={seed}"]
            load = os.getloadavg()[0]
            results[arm][seed] = run = run_arm(overrides)
            run["load_average"] = [round(load, 2), round(os.getloadavg()[0], 2)]
            print(f"{arm}, seed {seed}: {json.dumps(run['val'])}", flush=True)
    command = " ".join(
        ["python benchmarks/tools_demo.py", f"--seeds {args.seeds}", *args.overrides]
    )
    machine = f"{cpu_name()}, {os.cpu_count()} cores"
    RESULTS.mkdir(parents=True, exist_ok=True)
    record = {"command": command, "machine": machine, "model_build_s": build_s, "runs": results}
    (RESULTS / "tools_demo.json").write_text(json.dumps(record, indent=1))
    write_markdown(record)


def write_markdown(record: dict) -> None:
    results, command, machine = record["runs"], record["command"], record["machine"]
    curves = []
    for arm, runs in results.items():
        for seed, run in runs.items():
            curves += [f"\n{arm}, seed {seed}:\n", "| step | " + " | ".join(KEYS) + " |"]
            curves.append("|---:|" + "---:|" * len(KEYS))
            for point in run["val"]:
                values = " | ".join(f"{point[k]:.3f}" if k in point else "-" for k in KEYS)
                curves.append(f"| {point['step']} | {values} |")
    (RESULTS / "tools_demo.md").write_text(
        f"Tool demo ({CONFIG}; no tools: rollout.tools=[]), `{command}`, on {machine}; "
        f"builtin:tiny-tools built in {record['model_build_s']:.0f} s (0 when cached)\n\n"
        + "\n".join(table(results) + curves)
        + (f"\n\n{record['note']}\n" if record.get("note") else "\n")
    )


if __name__ == "__main__":
    main()
