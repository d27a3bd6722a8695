"""Autoscaled rollout workers on the Ray backend against a fixed one, on the long-tail
workload of ``benchmarks/partial.py`` (its rambling tiny model, config and settings).

Both runs start with one rollout worker (``pipeline.backend=ray``, a local Ray instance per
run); the autoscaled one has ``pipeline.autoscale_max=3`` (``honing/backends/autoscale.py``:
one worker more after ``--patience`` steps in which the trainer waited for generation, one
fewer when one fewer would still keep up). Each trains ``--steps`` steps under
``--mode`` (``async``: ``schedule.max_staleness=2``), ``--rounds`` times, alternating; the
figures are medians over rounds:

- generated tokens per second: the response tokens of the trained batches over the
  training time (the steps' times summed);
- the trainer's wait per step: ``timing_s/trainer_idle`` (waiting for a batch) under
  ``async``, the generation time ``timing_s/gen`` under ``sync`` (the trainer waits through
  it);
- the rollout workers each step saw (``ray/rollout_workers``, the first round's), and the
  autoscaler's changes (``rollout_workers_autoscaled`` events, step and count).

    .venv/bin/python -m benchmarks.ray_autoscale [--steps 30] [--rounds 2] [--mode async]

Writes benchmarks/results/ray_autoscale.{json,md} (``--out DIR``: elsewhere).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.moe import cpu_model
from benchmarks.partial import COMMON, CONFIG, MODES, RESULTS, ROOT, rambling_model

RAY = ["pipeline.backend=ray", "pipeline.rollout_workers=1", "pipeline.reward_workers=0"]
RUNS = {
    "fixed, 1 worker": [],
    "autoscaled, 1 to 3 workers": ["pipeline.autoscale_max=3"],
}


def run_once(name: str, mode: str, model: Path, args, workdir: Path) -> dict:
    run_dir = workdir / name.split(",")[0]
    command = [sys.executable, "-m", "honing.cli", "train", CONFIG, *COMMON, *MODES[mode]]
    command += [*RAY, *RUNS[name], f"pipeline.autoscale_patience={args.patience}"]
    command += [f"model.path={model}", f"trainer.total_steps={args.steps}"]
    command += ["--output-dir", str(run_dir), "--resume", "never"]
    subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    metrics = sorted(
        (m for m in _records(run_dir / "metrics.jsonl") if m["step"] >= 1),
        key=lambda m: m["step"],
    )
    seconds = sum(m["timing_s/step"] for m in metrics)
    tokens = sum(m["response_length/mean"] * m["samples/generated"] for m in metrics)
    wait = "timing_s/gen" if mode == "sync" else "timing_s/trainer_idle"
    changes = [
        f"{e['step']}: {e['before']}→{e['after']}"
        for e in _records(run_dir / "events.jsonl")
        if e["kind"] == "rollout_workers_autoscaled"
    ]
    return {
        "run": name,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "trainer_wait_s": statistics.fmean(m.get(wait, 0.0) for m in metrics),
        "workers": [int(m["ray/rollout_workers"]) for m in metrics],
        "changes": changes,
    }


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--mode", choices=("sync", "async"), default="async")
    parser.add_argument("--patience", type=int, default=2, help="pipeline.autoscale_patience")
    parser.add_argument("--ramble", type=int, default=8)
    parser.add_argument("--ramble-len", type=int, default=48)
    parser.add_argument("--model", type=Path, help="another model directory (a quick check)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the results go")
    args = parser.parse_args()
    model = args.model or rambling_model(args.ramble, args.ramble_len)
    runs: dict[str, list[dict]] = {name: [] for name in RUNS}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            order = list(RUNS) if round_ % 2 == 0 else list(reversed(RUNS))
            for name in order:
                result = run_once(name, args.mode, model, args, Path(tmp) / str(round_))
                runs[name].append(result)
                print(name, json.dumps(result))
    rows = []
    for name, results in runs.items():

        def med(key: str, results=results) -> float:
            return statistics.median(r[key] for r in results)

        rows.append(
            f"| {name} | {med('tokens_per_s'):.0f} | {med('seconds') / args.steps:.2f} | "
            f"{med('trainer_wait_s'):.3f} | {' '.join(map(str, results[0]['workers']))} | "
            f"{', '.join(results[0]['changes']) or '-'} |"
        )
    wait = "generation s/step" if args.mode == "sync" else "trainer idle s/step"
    command = (
        f"python -m benchmarks.ray_autoscale --steps {args.steps} --rounds {args.rounds} "
        f"--mode {args.mode} --patience {args.patience}"
    )
    table = [
        f"`{command}` ({cpu_model()}, {os.cpu_count()} cores; medians over {args.rounds} "
        "rounds, alternating; workers and changes: the first round's)",
        "",
        f"| rollout workers | generated tokens/s | s/step | {wait} | workers per step | "
        "autoscaled (step: before→after) |",
        "|---|---:|---:|---:|---|---|",
        *rows,
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    record = {"command": command, "mode": args.mode, "runs": runs}
    (args.out / "ray_autoscale.json").write_text(json.dumps(record, indent=1))
    (args.out / "ray_autoscale.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))


if __name__ == "__main__":
    main()
