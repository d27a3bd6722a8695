"""Crash recovery, measured: SIGKILL a supervised run at random moments; it must end exactly
where an uninterrupted run ends.

Trains the demo config (builtin:tiny, examples/arithmetic.yaml) for --steps steps with a
checkpoint every --every steps twice: once uninterrupted, once under ``supervise`` (what
``honing train --max-restarts N`` runs) while a watcher SIGKILLs the child --kills times, each
at a random moment of a randomly chosen step (after the step before it was logged, a random
pause of up to one step's time: generation, scoring, update, logging or the checkpoint save).
Then checks that every tensor of the final weights and optimizer state is equal, that each
step's reward is the same, and that every resume named a checkpoint whose manifest verified.
Writes benchmarks/results/fault_injection.json and .md.

    flock /tmp/honing-heavy.lock .venv/bin/python benchmarks/fault_injection.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from honing.checkpoint.manifest import build_manifest, verify
from honing.pipeline.supervise import supervise

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
CONFIG = "examples/arithmetic.yaml"


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.endswith("}")]


class Killer:
    """The supervisor's ``on_start``: schedules one SIGKILL per start, until ``kills`` ran.

    Kills alternate between two kinds of moment, so that both are certain to be hit: a random
    point of a step's interval (most often generation or the update), and the middle of a
    checkpoint save (as soon as a ``.tmp-step_*`` directory appears, plus up to 5 ms).
    """

    def __init__(self, run_dir: Path, targets: list[int], step_s: float, rng: random.Random):
        self.run_dir, self.targets, self.step_s, self.rng = run_dir, list(targets), step_s, rng
        self.scheduled = 0  # counted at once: the next start can come before a kill is logged
        self.done: list[dict] = []

    def __call__(self, pid: int) -> None:
        if self.scheduled < len(self.targets):
            target = self.targets[self.scheduled]
            during_save = self.scheduled % 2 == 1
            self.scheduled += 1
            pause = self.rng.uniform(0, 0.005 if during_save else self.step_s)
            threading.Thread(
                target=self._kill, args=(pid, target, pause, during_save), daemon=True
            ).start()

    def _saving(self) -> list[str]:
        root = self.run_dir / "checkpoints"
        names = os.listdir(root) if root.is_dir() else []
        return [name for name in names if name.startswith(".tmp-step_")]

    def _kill(self, pid: int, target: int, pause: float, during_save: bool) -> None:
        started = time.time()
        metrics = self.run_dir / "metrics.jsonl"
        while not any(m["step"] >= target - 1 for m in read_jsonl(metrics) if m["time"] >= started):
            if not alive(pid):
                return  # finished or crashed before the target step
            time.sleep(0.02)
        if during_save:
            while not self._saving():
                if not alive(pid):
                    return
                time.sleep(0.001)
        time.sleep(pause)
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)  # gone; the restarted child takes seconds to start
            self.done.append(
                {
                    "during_step": target - 1 if during_save else target,
                    "moment": "checkpoint save" if during_save else "random",
                    "pause_s": round(pause, 4),
                    "after_start_s": round(time.time() - 0.2 - started, 2),
                    "partial_checkpoints_left": self._saving(),
                }
            )


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def compare(dir_a: Path, dir_b: Path, step: int) -> dict:
    """Tensor-by-tensor equality of the final weights and trainer state of two runs."""
    ckpt_a, ckpt_b = dir_a / "checkpoints" / f"step_{step}", dir_b / "checkpoints" / f"step_{step}"
    weights_a = load_file(ckpt_a / "model.safetensors")
    weights_b = load_file(ckpt_b / "model.safetensors")
    unequal = [k for k in weights_a if not torch.equal(weights_a[k], weights_b[k])]

    def optimizer_state(checkpoint):
        state = torch.load(checkpoint / "trainer_state.pt", weights_only=True)
        return state["trainers"]["policy"]["optimizer"]["state"]

    state_a, state_b = optimizer_state(ckpt_a), optimizer_state(ckpt_b)
    optimizer_equal = state_a.keys() == state_b.keys() and all(
        torch.equal(state_a[i][k], state_b[i][k]) for i in state_a for k in state_a[i]
    )
    scores = lambda d: {
        m["step"]: m.get("critic/score/mean") for m in read_jsonl(d / "metrics.jsonl")
    }  # noqa: E731
    return {
        "tensors": len(weights_a),
        "same_keys": weights_a.keys() == weights_b.keys(),
        "unequal_tensors": unequal,
        "weights_equal": weights_a.keys() == weights_b.keys() and not unequal,
        "optimizer_state_equal": optimizer_equal,
        "scores_equal": scores(dir_a) == scores(dir_b),
    }


def verify_cost(checkpoint: Path, repeats: int = 5) -> dict:
    """Seconds to hash a checkpoint (what a save adds) and to verify it (what a resume adds)."""
    size = sum(p.stat().st_size for p in checkpoint.rglob("*") if p.is_file())
    timings = {}
    for name, work in (
        ("manifest_s", lambda: build_manifest(checkpoint)),
        ("verify_s", lambda: verify(checkpoint)),
    ):
        samples = []
        for _ in range(repeats):
            started = time.perf_counter()
            work()
            samples.append(time.perf_counter() - started)
        timings[name] = sorted(samples)[len(samples) // 2]
    return {"checkpoint_bytes": size, **timings}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=1, help="checkpoint.every")
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0, help="chooses the kill moments")
    args = parser.parse_args()
    overrides = [
        f"trainer.total_steps={args.steps}",
        "trainer.val_every=10",
        f"checkpoint.every={args.every}",
        "checkpoint.keep=2",
        "monitor.console=false",
        "monitor.tensorboard=false",
    ]
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        reference, faulted = Path(tmp) / "reference", Path(tmp) / "faulted"
        started = time.perf_counter()
        subprocess.run(
            [
                sys.executable,
                "-m",
                "honing.cli",
                "train",
                CONFIG,
                *overrides,
                "--output-dir",
                str(reference),
            ],
            check=True,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
        )
        reference_s = time.perf_counter() - started
        # A step's whole interval (generation .. checkpoint save), from the logged times.
        times = [m["time"] for m in read_jsonl(reference / "metrics.jsonl") if m["step"] > 0]
        intervals = sorted(b - a for a, b in zip(times, times[1:], strict=False))
        step_s = intervals[len(intervals) // 2]
        targets = sorted(rng.sample(range(2, args.steps + 1), args.kills))
        killer = Killer(faulted, targets, step_s, rng)
        lines: list[str] = []
        started = time.perf_counter()
        status = supervise(
            [CONFIG, *overrides, "--output-dir", str(faulted)],
            max_restarts=args.kills + 2,
            log=lines.append,
            on_start=killer,
            restart_delay_s=0,
        )
        faulted_s = time.perf_counter() - started
        events = read_jsonl(faulted / "events.jsonl")
        verified = {e["path"] for e in events if e["kind"] == "checkpoint_verified"}
        resumes = [e for e in events if e["kind"] in ("resumed", "restarted")]
        result = {
            "config": CONFIG,
            "overrides": overrides,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "exit_status": status,
            "kills": killer.done,
            "restarts": sum(e["kind"] == "restart" for e in events),
            "restart_exit_statuses": [e["exit_status"] for e in events if e["kind"] == "restart"],
            "resumed_from": [e.get("checkpoint") for e in resumes],
            "every_resume_verified": all(
                e.get("checkpoint") in verified for e in resumes if e.get("checkpoint")
            ),
            "corrupt_skipped": [e for e in events if e["kind"] == "checkpoint_corrupt"],
            "reference_wall_s": round(reference_s, 1),
            "faulted_wall_s": round(faulted_s, 1),
            "median_step_interval_s": round(step_s, 3),
            **compare(reference, faulted, args.steps),
            **verify_cost(reference / "checkpoints" / f"step_{args.steps}"),
        }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "fault_injection.json").write_text(json.dumps(result, indent=1) + "\n")
    (RESULTS / "fault_injection.md").write_text(markdown(result))
    print(markdown(result))


def markdown(r: dict) -> str:
    kills = "\n".join(
        f"| {k['during_step']} | {k['moment']} | {k['pause_s']} | {k['after_start_s']} | "
        f"{', '.join(k['partial_checkpoints_left']) or '-'} |"
        for k in r["kills"]
    )
    resumed = ", ".join(Path(p).name if p else "scratch" for p in r["resumed_from"])
    return f"""# Fault injection: SIGKILL at random moments under the supervisor

`{r["config"]}` with {" ".join(r["overrides"])}; {r["machine"]}.

| | |
|---|---|
| kills (SIGKILL) | {len(r["kills"])} |
| restarts (events) | {r["restarts"]} (exit statuses {r["restart_exit_statuses"]}) |
| final exit status | {r["exit_status"]} |
| every resume loaded a verified checkpoint | {r["every_resume_verified"]} |
| resumed from | {resumed} |
| damaged checkpoints skipped | {len(r["corrupt_skipped"])} |
| final weights equal (torch.equal, {r["tensors"]} tensors) | {r["weights_equal"]} |
| optimizer state equal | {r["optimizer_state_equal"]} |
| per-step reward equal | {r["scores_equal"]} |
| wall time, uninterrupted | {r["reference_wall_s"]} s |
| wall time, with kills and restarts | {r["faulted_wall_s"]} s |
| median step interval (train, log, save) | {r["median_step_interval_s"]} s |
| checkpoint size | {r["checkpoint_bytes"] / (1 << 20):.2f} MiB |
| manifest at save (sha256 of every file) | {1000 * r["manifest_s"]:.1f} ms |
| verification at resume | {1000 * r["verify_s"]:.1f} ms |

Kill moments: "random" is a random pause after the step before was logged; "checkpoint save"
is up to 5 ms after the save's temporary directory appeared. A partial checkpoint left by a
kill is never loaded: the restarted run removes it and resumes from the newest verified one.

| during step | moment | pause (s) | after child start (s) | partial checkpoint left |
|---|---|---|---|---|
{kills}
"""


if __name__ == "__main__":
    main()
