"""The demo on other CPUs' kernels: does `make demo` start and end in the same place?

The tiny model is built from scratch on the machine that runs the demo, so another CPU's
kernels (another SIMD width, another summation order in MKL's matrix products) give a
warm start that differs in the last bits, which training can amplify. This runs the demo
(`honing train examples/arithmetic.yaml`, an empty model cache each time) under the kernel
paths this machine can take: its own, AVX2 and no SIMD at all (PyTorch's
``ATEN_CPU_CAPABILITY`` with MKL's ``MKL_ENABLE_INSTRUCTIONS``), and writes
benchmarks/results/demo_kernels.json and .md. Run it alone on the machine:

    .venv/bin/python -m benchmarks.demo_kernels
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.moe import cpu_model

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PATHS = {
    "native": {},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "no_simd": {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
}


def demo(kernels: dict[str, str], workdir: Path) -> dict:
    """One `make demo` equivalent under ``kernels``: build, warm start, train 500 steps."""
    env = os.environ | kernels | {"HONING_CACHE": str(workdir / "cache")}
    run_dir = workdir / "run"
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "honing.cli", "train", "examples/arithmetic.yaml"]
        + ["monitor.console=false", "--output-dir", str(run_dir), "--resume", "never"],
        check=True,
        cwd=ROOT,
        env=env,
        capture_output=True,
    )
    wall = time.perf_counter() - started
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "kernels": kernels,
        "wall_s": round(wall, 1),
        "train_s": summary["seconds"],
        "val_accuracy": [summary["val_accuracy_start"], summary["val_accuracy_end"]],
        "pass_at_8": [summary["pass_at_k_start"], summary["pass_at_k_end"]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--paths", default=",".join(PATHS), help="kernel paths, comma-separated")
    args = parser.parse_args()
    rows = {}
    for name in args.paths.split(","):
        with tempfile.TemporaryDirectory(prefix="honing-demo-kernels-") as scratch:
            rows[name] = demo(PATHS[name], Path(scratch))
        print(name, rows[name], flush=True)
    import torch

    machine = {
        "cpu": platform.processor() or platform.machine(),
        "cpu_model": cpu_model(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "native_capability": torch.backends.cpu.get_cpu_capability(),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    report = {"machine": machine, "runs": rows}
    (RESULTS / "demo_kernels.json").write_text(json.dumps(report, indent=1))
    starts = [r["val_accuracy"][0] for r in rows.values()]
    ends = [r["val_accuracy"][1] for r in rows.values()]
    lines = [
        "# The demo on three CPUs' kernel paths",
        "",
        f"Command: `python -m benchmarks.demo_kernels`; machine: {machine['cpu_model']}, "
        f"{machine['cores']} cores, torch {machine['torch']} (native kernels: "
        f"{machine['native_capability']}). Each row builds the tiny model from an empty cache "
        "and trains the demo (examples/arithmetic.yaml, 500 steps) with that path's kernels.",
        "",
        "| kernels | environment | val/accuracy | val/pass@8 | training s | all s |",
        "|---|---|---|---|---:|---:|",
    ]
    for name, row in rows.items():
        env = " ".join(f"{k}={v}" for k, v in row["kernels"].items()) or "(none)"
        acc, pass8 = row["val_accuracy"], row["pass_at_8"]
        lines.append(
            f"| {name} | `{env}` | {acc[0]:.3f} → {acc[1]:.3f} | {pass8[0]:.3f} → {pass8[1]:.3f} "
            f"| {row['train_s']:.0f} | {row['wall_s']:.0f} |"
        )
    lines += [
        "",
        f"Spread across paths: start {max(starts) - min(starts):.3f}, "
        f"end {max(ends) - min(ends):.3f}.",
    ]
    (RESULTS / "demo_kernels.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
