"""What sharding costs and saves: one process against two torchrun ranks, replicated and FSDP2.

The grpo_step benchmark's ~47M-parameter Qwen2 (hidden 512, 10 layers, 32k vocabulary) at
128 new tokens (8 prompts x 8 completions, no reference), three ways, alternating,
``--rounds`` times:
- ``one``: one process with both cores' threads (``trainer.threads=2``);
- ``replicate``: ``torchrun --nproc_per_node 2``, one thread a rank, each rank holding the whole
  model (``trainer.strategy=replicate``), generation spread over both;
- ``fsdp``: the same two ranks with ``trainer.strategy=fsdp``: each holds half the parameters,
  gradients and optimizer state; generation on each rank's own whole copy, which takes the
  gathered weights after every update.

Per run: medians over the steps after the first of ``timing_s/{gen,update,sync,step}``,
``perf/sync_mb`` and rank 0's ``memory/model_state_mb`` from metrics.jsonl, and each rank's
peak resident memory (sampled from /proc while it runs). Reported: the medians over rounds.

    .venv/bin/python -m benchmarks.sharding [--rounds 2] [--steps 4]

writes benchmarks/results/sharding.{json,md}. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from benchmarks.grpo_step import M50, RESULTS, SEED, WORK, Workload, honing_overrides, revision
from benchmarks.grpo_workloads import alternating, build_model_dir, peer_data

VARIANTS = {
    "one": (1, 2, ["trainer.strategy=replicate"]),
    "replicate": (2, 1, ["trainer.strategy=replicate"]),
    "fsdp": (2, 1, ["trainer.strategy=fsdp"]),
}
FIGURES = (
    "timing_s/gen",
    "timing_s/update",
    "timing_s/sync",
    "timing_s/step",
    "perf/sync_mb",
    "memory/model_state_mb",
)


def peak_rss(process: subprocess.Popen, every_s: float = 0.2) -> dict[int, float]:
    """The most resident memory (MB) each honing process under ``process`` had, sampled until
    it ends (torchrun's ranks, or the process itself)."""
    peaks: dict[int, float] = {}
    root = psutil.Process(process.pid)
    while process.poll() is None:
        try:
            family = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            break
        for member in family:
            try:
                if "honing.cli" in " ".join(member.cmdline()):
                    rss = member.memory_info().rss / 2**20
                    peaks[member.pid] = max(peaks.get(member.pid, 0.0), rss)
            except psutil.Error:
                continue
        time.sleep(every_s)
    return peaks


def run(name: str, steps: int, model_dir: Path, data: dict, out: Path) -> dict:
    """One run of variant ``name``: its medians (the first step left out) and peak RSS."""
    ranks, threads, extra = VARIANTS[name]
    work = Workload("m50_t128", M50, 128, 0.0, steps, 1)
    command = [sys.executable]
    if ranks > 1:
        command += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]
    command += ["-m", "honing.cli", "train", *honing_overrides(work, model_dir, data, threads)]
    command += [*extra, "--output-dir", str(out), "--resume", "never"]
    subprocess.run(["rm", "-rf", str(out)], check=True)
    log = out.with_suffix(".log")
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as sink:
        child = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
        peaks: dict[int, float] = {}
        sampler = threading.Thread(target=lambda: peaks.update(peak_rss(child)))
        sampler.start()
        child.wait()
        sampler.join()
    if child.returncode != 0:
        raise RuntimeError(f"{name} failed (exit {child.returncode}); see {log}")
    lines = (out / "metrics.jsonl").read_text().splitlines()
    metrics = [m for m in map(json.loads, lines) if m.get("step", 0) >= 2 and "timing_s/gen" in m]
    result = {key: statistics.median(m.get(key, 0.0) for m in metrics) for key in FIGURES}
    result["peak_rss_mb"] = sorted(peaks.values(), reverse=True)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args(argv)
    model_dir = WORK / "models" / M50.name
    build_model_dir(M50, model_dir, SEED)
    data = peer_data(WORK, SEED)
    code, started = revision(), time.time()
    runs: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    for round_index, name in alternating(args.rounds, VARIANTS):
        out = WORK / "runs" / "sharding" / f"{round_index}_{name}"
        runs[name].append(run(name, args.steps, model_dir, data, out))
        last = runs[name][-1]
        print(
            f"round {round_index} {name:9s}: step {last['timing_s/step']:.2f} s, "
            f"model state {last['memory/model_state_mb']:.0f} MB, "
            f"peak RSS {[round(x) for x in last['peak_rss_mb']]} MB",
            flush=True,
        )
    medians = {
        name: {
            **{key: statistics.median(r[key] for r in results) for key in FIGURES},
            "peak_rss_mb": max(max(r["peak_rss_mb"]) for r in results),
        }
        for name, results in runs.items()
    }
    report = {
        "revision": code,
        "command": "python -m benchmarks.sharding " + " ".join(argv or sys.argv[1:]),
        "wall_s": round(time.time() - started, 1),
        "workload": "~47M-parameter Qwen2 (32k vocabulary), 8 prompts x 8 completions, "
        "128 new tokens, no reference",
        "runs": runs,
        "medians": medians,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "sharding.json").write_text(json.dumps(report, indent=1))
    (RESULTS / "sharding.md").write_text(markdown(report))
    print(markdown(report))


def markdown(report: dict) -> str:
    medians = report["medians"]
    held = {name: m["memory/model_state_mb"] for name, m in medians.items()}
    rows = [
        f"| {name} | {m['timing_s/step']:.2f} | {m['timing_s/gen']:.2f} | "
        f"{m['timing_s/update']:.2f} | {m['timing_s/sync']:.3f} | {m['perf/sync_mb']:.0f} | "
        f"{held[name]:.0f} ({held[name] / held['one']:.2f}x) | {m['peak_rss_mb']:.0f} |"
        for name, m in medians.items()
    ]
    return "\n".join(
        [
            "# Sharded training (`trainer.strategy`)",
            "",
            f"{report['workload']}; 2-core CPU VM; revision {report['revision']}; "
            f"`{report['command'].strip()}` ({report['wall_s']} s). Medians over rounds of "
            "each run's median (first step left out); model state: rank 0's parameters + "
            "gradients + optimizer state; peak RSS: the largest process's.",
            "",
            "| variant | step s | gen s | update s | sync s | sync MB | model state MB | "
            "peak RSS MB |",
            "|---|---|---|---|---|---|---|---|",
            *rows,
            "",
            "`one`: one process, 2 threads. `replicate`: 2 torchrun ranks of 1 thread, each "
            "holding the whole model. `fsdp`: the same ranks, each holding half the model "
            "state; each samples with a whole copy of its own that takes the gathered weights "
            "after every update (`sync`).",
            "",
            "Under `fsdp` the logprob passes run the model's own forward: the packed pass and "
            "the chunked LM head read weights outside the layers' forwards, which a sharded "
            "model has only inside them. On this workload (32k vocabulary, little else) that "
            "costs update time and the full [rows, positions, vocabulary] logits in each "
            "rank's memory; what sharding divides is the model-state column, which dominates "
            "a large model's memory.",
            "",
        ]
    )


if __name__ == "__main__":
    main()
