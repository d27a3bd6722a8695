"""Monitoring overhead per training step, measured against the demo's step time.

Feeds the demo workload's per-step metrics through ``RunLogger`` with every sink on:
``metrics.jsonl``, the console (a live TTY line redrawn every step: its worst case),
TensorBoard scalars plus histograms of the step's 128 rewards and 128 response lengths, and
the Prometheus endpoint (scraped over loopback HTTP every ``--scrape-every`` steps, the
scrape timed inside the step: an upper bound). The timed step also includes the work the
loop does for monitoring: ``system_metrics()`` and ``distribution_metrics`` of rewards and
lengths. Each sink is also measured alone, for the breakdown.

The metric names and value ranges are those of a demo step (examples/arithmetic.yaml:
batch 16 x group 8 = 128 samples of at most 4 tokens, validation every 25 steps). The step
time to compare with is read from benchmarks/results/demo_curve.json (the smaller median of
its runs, so the percentage errs high). Run it alone on the machine:

    flock /tmp/honing-heavy.lock .venv/bin/python benchmarks/monitor_overhead.py
"""

from __future__ import annotations

import argparse
import io
import json
import platform
import random
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

from honing.monitor import RunLogger
from honing.monitor.logger import distribution_metrics
from honing.monitor.system import system_metrics
from honing.services.process import free_port

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
SAMPLES_PER_STEP = 128  # rollout.batch_size 16 x rollout.group_size 8
VAL_EVERY = 25

# Names a demo step logs (from a real run's metrics.jsonl), with a typical magnitude.
STEP_METRICS = {
    "response_length/mean": 3.0,
    "response_length/max": 4,
    "response_length/clip_ratio": 0.8,
    "samples/generated": 128,
    "samples/failed": 0,
    "samples/filtered": 0,
    "samples/score_errors": 0,
    "samples/gen_rounds": 1,
    "reward/latency_p50_ms": 0.003,
    "reward/latency_p99_ms": 0.005,
    "critic/score/mean": 0.6,
    "critic/score/max": 1.0,
    "critic/score/min": 0.0,
    "critic/advantages/mean": 1e-8,
    "samples/trained": 128,
    "samples/filtered_truncated": 0,
    "actor/pg_clipfrac": 0.01,
    "actor/pg_clipfrac_lower": 0.0,
    "actor/ppo_kl": 1e-4,
    "actor/pg_loss": -0.01,
    "actor/entropy": 0.9,
    "actor/grad_norm": 1.2,
    "actor/skipped_updates": 0,
    "actor/lr": 1e-4,
    "timing_s/update": 0.08,
    "timing_s/prepare": 0.001,
    "timing_s/gen": 0.04,
    "timing_s/reward": 0.0004,
    "timing_s/step": 0.13,
    "perf/throughput": 9000.0,
}
VAL_METRICS = {"val/accuracy": 0.85, "val/pass@8": 0.95, "val/mean@8": 0.7}


class Terminal(io.StringIO):
    """A console stream that claims to be a TTY, so the line is redrawn every step."""

    def isatty(self) -> bool:
        return True


def workload(steps: int, seed: int) -> list[tuple[dict, list[float], list[int]]]:
    """Per step: the metrics, 128 rewards and 128 response lengths (made before timing)."""
    rng = random.Random(seed)
    made = []
    for step in range(1, steps + 1):
        metrics = {k: v * rng.uniform(0.5, 1.5) for k, v in STEP_METRICS.items()}
        if step % VAL_EVERY == 0:
            metrics |= {k: v * rng.uniform(0.9, 1.0) for k, v in VAL_METRICS.items()}
        rewards = [float(rng.random() < 0.6) for _ in range(SAMPLES_PER_STEP)]
        lengths = [rng.randint(1, 4) for _ in range(SAMPLES_PER_STEP)]
        made.append((metrics, rewards, lengths))
    return made


def run_config(name: str, options: dict, steps: int, scrape_every: int, seed: int) -> dict:
    """Times each step's monitoring work under one sink configuration."""
    data = workload(steps, seed)
    monitor = SimpleNamespace(**options)
    per_step: list[float] = []
    with tempfile.TemporaryDirectory() as run_dir:
        started = time.perf_counter()
        logger = RunLogger.from_config(run_dir, monitor, total_steps=steps, stream=Terminal())
        prometheus = next((s for s in logger.sinks if hasattr(s, "url")), None)
        setup = time.perf_counter() - started
        for step, (metrics, rewards, lengths) in enumerate(data, start=1):
            t0 = time.perf_counter()
            metrics = metrics | system_metrics()
            metrics |= distribution_metrics("response_length", lengths)
            metrics |= distribution_metrics("critic/score", rewards)
            logger.log_histograms(step, {"critic/score": rewards, "response_length": lengths})
            logger.log_metrics(step, metrics)
            if prometheus is not None and step % scrape_every == 0:
                with urllib.request.urlopen(prometheus.url, timeout=5) as response:
                    response.read()
            per_step.append(time.perf_counter() - t0)
        started = time.perf_counter()
        logger.close()
        teardown = time.perf_counter() - started
    ordered = sorted(per_step)
    return {
        "config": name,
        "median_ms": 1000 * statistics.median(per_step),
        "mean_ms": 1000 * statistics.fmean(per_step),
        "p90_ms": 1000 * ordered[int(0.9 * (len(ordered) - 1))],
        "max_ms": 1000 * ordered[-1],
        "setup_s": setup,
        "close_s": teardown,
    }


CONFIGS = {
    "jsonl only": {"console": False, "tensorboard": False},
    "jsonl + console (tty)": {"console": True, "tensorboard": False},
    "jsonl + tensorboard (scalars + histograms)": {"console": False, "tensorboard": True},
    "jsonl + prometheus (scraped)": {"console": False, "tensorboard": False, "prometheus_port": -1},
    "all sinks": {"console": True, "tensorboard": True, "prometheus_port": -1},
}


def demo_step_seconds() -> float:
    """The demo's median step time: the smaller of the runs in demo_curve.json."""
    runs = json.loads((RESULTS / "demo_curve.json").read_text())["runs"]
    return min(run["median_step_s"] for run in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=500, help="steps per repeat (demo: 500)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--scrape-every", type=int, default=10, help="steps between scrapes")
    args = parser.parse_args()
    port = free_port()
    results: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    for repeat in range(args.repeats):  # configs interleaved, so drift hits all alike
        for name, options in CONFIGS.items():
            options = {k: (port if v == -1 else v) for k, v in options.items()}
            results[name].append(run_config(name, options, args.steps, args.scrape_every, repeat))
    step_s = demo_step_seconds()
    rows = []
    for name, runs in results.items():
        median_ms = statistics.median(r["median_ms"] for r in runs)
        mean_ms = statistics.median(r["mean_ms"] for r in runs)
        rows.append(
            {
                "config": name,
                "median_ms_per_step": median_ms,
                "mean_ms_per_step": mean_ms,
                "p90_ms_per_step": statistics.median(r["p90_ms"] for r in runs),
                "percent_of_step_time": 100 * mean_ms / 1000 / step_s,
                "setup_s": statistics.median(r["setup_s"] for r in runs),
                "close_s": statistics.median(r["close_s"] for r in runs),
                "repeats": runs,
            }
        )
        print(f"{name:38s} mean {mean_ms:6.3f} ms/step = {rows[-1]['percent_of_step_time']:.2f}%")
    _write(rows, step_s, args)


def _write(rows: list[dict], step_s: float, args: argparse.Namespace) -> None:
    every = next(r for r in rows if r["config"] == "all sinks")
    result = {
        "demo_step_s": step_s,
        "steps": args.steps,
        "repeats": args.repeats,
        "scrape_every": args.scrape_every,
        "samples_per_step": SAMPLES_PER_STEP,
        "machine": platform.processor() or platform.machine(),
        "target_percent": 2.0,
        "all_sinks_percent": every["percent_of_step_time"],
        "rows": rows,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "monitor_overhead.json").write_text(json.dumps(result, indent=1))
    lines = [
        "| sinks | median ms/step | mean ms/step | p90 ms/step | % of demo step | setup s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['config']} | {r['median_ms_per_step']:.3f} | {r['mean_ms_per_step']:.3f} | "
        f"{r['p90_ms_per_step']:.3f} | {r['percent_of_step_time']:.2f} | {r['setup_s']:.2f} |"
        for r in rows
    ]
    (RESULTS / "monitor_overhead.md").write_text(
        f"Monitoring overhead per step ({args.steps} steps x {args.repeats} repeats, medians of "
        f"repeats; {SAMPLES_PER_STEP}-value reward and length histograms; Prometheus scraped "
        f"every {args.scrape_every} steps) against the demo's {step_s * 1000:.0f} ms step "
        f"(benchmarks/results/demo_curve.json). Every row includes system_metrics() and the "
        f"percentile metrics. Target: all sinks < 2%; measured "
        f"{every['percent_of_step_time']:.2f}%.\n\n" + "\n".join(lines) + "\n"
    )


if __name__ == "__main__":
    main()
