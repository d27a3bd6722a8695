"""honing against TRL's GRPOTrainer, side by side on the same model, prompts and reward.

Each workload (a random Qwen2, 8 prompts x 8 completions, one optimizer step per generation
batch, with or without a k3 KL loss to a reference model) runs ``--pairs`` times on each
system, alternating which goes first. TRL runs through the peer script
(../shared/peers/trl_grpo_bench.py) with ``.venv-peers``' Python (``make bench-setup``);
honing through ``honing train`` with this Python. Both read the same model directory.

What is compared, per system and workload:
- step time: TRL's time between consecutive step ends (the peer script's
  ``since_prev_step_end_s``); honing's interval between consecutive ``time`` stamps of
  metrics.jsonl, less the end-of-run validation on the last step. Both include logging; the
  first step is warm-up and excluded. The median is over every measured step of every pair;
  the ratio's spread is the min-max of the per-pair ratios of medians;
- completion tokens/s: mean completion length x 64 / median step time (random models stop
  at EOS now and then; the mean length is reported for both);
- stages (medians): gen, reward, ref (reference logprobs), update (policy forward, loss,
  backward, optimizer), rest (the step less those: collation, advantages, logging);
- peak RSS of the process, from ``wait4``'s rusage for both.

    .venv/bin/python -m benchmarks.grpo_step [--quick] [--workloads a,b] [--lock FILE]

writes benchmarks/results/grpo_step.{json,md} (``--tag`` names other files). Models, data and
run directories go under runs/bench/.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from benchmarks.grpo_report import write_markdown
from benchmarks.grpo_workloads import ModelSpec, build_model_dir, peer_data

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
WORK = ROOT / "runs" / "bench"
PEER_SCRIPT = ROOT.parent / "shared" / "peers" / "trl_grpo_bench.py"
PEERS_PYTHON = ROOT / ".venv-peers" / "bin" / "python"
REWARD_FN = ROOT / "benchmarks" / "grpo_rewards.py"
COMPLETIONS_PER_STEP = 64  # 8 prompts x 8 completions, on both sides
SEED = 42  # the peer script's default: same model weights and prompts

PEER = ModelSpec("peer")  # 594,560 parameters, 20-entry vocabulary
VOCAB_32K = ModelSpec("peer_v32k", vocab_size=32768)
VOCAB_152K = ModelSpec("peer_v152k", vocab_size=151936)  # Qwen2's vocabulary size
M10 = ModelSpec("m10_v32k", 256, 4, 4, 2, 768, vocab_size=32768, max_positions=1024)
M50 = ModelSpec("m50_v32k", 512, 10, 8, 2, 1536, vocab_size=32768, max_positions=1024)


@dataclass(frozen=True)
class Workload:
    """One side-by-side comparison: model, completion length, KL coefficient, run sizes."""

    name: str
    model: ModelSpec
    max_new_tokens: int
    beta: float
    steps: int  # per run; the first is warm-up
    pairs: int


WORKLOADS = [
    Workload("peer_ref", PEER, 16, 0.04, 11, 3),
    Workload("peer_noref", PEER, 16, 0.0, 11, 3),
    Workload("vocab32k_t16", VOCAB_32K, 16, 0.04, 4, 1),
    Workload("vocab152k_t16", VOCAB_152K, 16, 0.04, 4, 1),
    Workload("m10_t128", M10, 128, 0.04, 4, 1),
    Workload("m50_t128", M50, 128, 0.04, 3, 1),
    Workload("m10_t512", M10, 512, 0.04, 3, 1),
]
# Left out of the default run (``--full`` adds them), with the reason.
FULL_ONLY = {
    "m10_t512": "512 new tokens with the 10M model take ~2 min per step on 2 cores for TRL "
    "(115-124 s measured): one pair of 3-step runs takes 8-12 min, which would push "
    "`make bench` past 20 minutes; run it with `--workloads m10_t512 --steps 3`",
}


def run_child(command: list[str], log: Path) -> tuple[int, float, float]:
    """Runs ``command`` with output to ``log``; returns (exit code, peak RSS in MB, wall s).

    The peak RSS comes from ``wait4``'s rusage of that one child (the same method for both
    systems; neither spawns worker processes on these workloads).
    """
    env = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    started = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, usage.ru_maxrss / 1024, time.perf_counter() - started


def _summarise(steps: list[float], stages: list[dict], lengths: list[float]) -> dict:
    keys = sorted({k for s in stages for k in s})
    median_step = statistics.median(steps)
    mean_length = statistics.median(lengths)
    return {
        "step_s": steps,
        "median_step_s": median_step,
        "completion_mean_length": mean_length,
        "completion_tokens_per_s": mean_length * COMPLETIONS_PER_STEP / median_step,
        "stages_s": {k: statistics.median([s.get(k, 0.0) for s in stages]) for k in keys},
    }


def run_trl(work: Workload, model_dir: Path, run_dir: Path, peer_script: Path) -> dict:
    """One TRL run of ``work``; the peer script's own JSON is kept as ``trl.json``."""
    out = run_dir / "trl.json"
    command = [str(PEERS_PYTHON), str(peer_script), "--model-dir", str(model_dir)]
    command += ["--beta", str(work.beta), "--max-steps", str(work.steps)]
    command += ["--max-completion-length", str(work.max_new_tokens), "--seed", str(SEED)]
    command += ["--out", str(out)]
    rc, rss, wall = run_child(command, run_dir / "trl.log")
    if rc != 0:
        raise RuntimeError(f"TRL run failed ({rc}); see {run_dir / 'trl.log'}")
    peer = json.loads(out.read_text())
    steps, stages, lengths = [], [], []
    for record in peer["records"][1:]:
        phases, interval = record["phases_s"], record["since_prev_step_end_s"]
        stage = {
            "gen": phases.get("generate", 0.0),
            "reward": phases.get("reward", 0.0),
            "ref": phases.get("ref_logps", 0.0),
            "update": sum(
                phases.get(k, 0.0)
                for k in ("compute_loss", "backward(+clip)", "optimizer.step")
                + ("post-step(lr sched, zero_grad)",)
            ),
        }
        stage["rest"] = interval - sum(stage.values())
        steps.append(interval)
        stages.append(stage)
        lengths.append(record.get("logs", {}).get("completions/mean_length", float("nan")))
    summary = _summarise(steps, stages, lengths)
    summary |= {
        "peak_rss_mb": rss,
        "wall_s": wall,
        "threads": peer["torch_threads"],
        "params": peer["params"],
        "versions": peer["versions"],
        "cpu_probe_s": peer["cpu_probe_s_before_after"],
        "activation_checkpointing": bool(peer["cli_args"]["gradient_checkpointing"]),
    }
    return summary


def honing_overrides(work: Workload, model_dir: Path, data: dict, threads: int) -> list[str]:
    """``honing train`` overrides equivalent to the peer script's GRPOConfig."""
    return [
        f"model.path={model_dir}",
        f"data.train_files=[{data['train']}]",
        f"data.val_files=[{data['val']}]",
        f"reward.function={REWARD_FN}:starts_with_answer",
        "rollout.engine=transformers",  # honing's own engine: what the recorded rows measured
        "rollout.batch_size=8",
        "rollout.group_size=8",
        f"rollout.max_new_tokens={work.max_new_tokens}",
        f"rollout.max_seq_len={work.max_new_tokens + 64}",
        "rollout.temperature=1.0",
        "rollout.val_samples=1",
        f"algorithm.kl_coef={work.beta}",
        "algorithm.kl_estimator=k3",
        "trainer.lr=0.001",
        "trainer.lr_schedule=constant",
        "trainer.ppo_epochs=1",
        "trainer.mini_batch_size=0",
        f"trainer.total_steps={work.steps}",
        "trainer.val_every=0",
        "trainer.val_at_start=false",
        f"trainer.threads={threads}",
        f"trainer.seed={SEED}",
        "checkpoint.every=0",
        "monitor.console=false",
        "monitor.tensorboard=false",
        "monitor.histograms=false",
        "monitor.system_metrics=false",
        "monitor.log_samples=0",
    ]


def run_honing(work: Workload, model_dir: Path, data: dict, run_dir: Path, threads: int) -> dict:
    """One honing run of ``work`` in ``run_dir / "honing"``."""
    out_dir = run_dir / "honing"
    code = revision()  # taken before the child imports honing
    command = [sys.executable, "-m", "honing.cli", "train"]
    command += honing_overrides(work, model_dir, data, threads)
    command += ["--output-dir", str(out_dir), "--resume", "never"]
    rc, rss, wall = run_child(command, run_dir / "honing.log")
    if rc != 0:
        raise RuntimeError(f"honing run failed ({rc}); see {run_dir / 'honing.log'}")
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    records = sorted((json.loads(line) for line in lines), key=lambda r: r["step"])
    records = [r for r in records if r["step"] >= 1]
    steps, stages, lengths = [], [], []
    for previous, record in zip(records, records[1:], strict=False):
        # The last step validates before it logs; TRL's last step does not.
        interval = record["time"] - previous["time"] - record.get("timing_s/val", 0.0)
        stage = {k: record.get(f"timing_s/{k}", 0.0) for k in ("gen", "reward", "ref", "update")}
        stage["old"] = record.get("timing_s/old", 0.0)
        stage["sync"] = record.get("timing_s/sync", 0.0)
        stage["rest"] = interval - sum(stage.values())
        steps.append(interval)
        stages.append(stage)
        lengths.append(record["response_length/mean"])
    summary = _summarise(steps, stages, lengths)
    summary |= {"peak_rss_mb": rss, "wall_s": wall, "threads": threads, "revision": code}
    return summary


def revision() -> str:
    """honing's commit, with ``+dirty`` when honing/ has uncommitted changes: the code a run
    measured (the package is read from the working tree at each run's start)."""
    git = ["git", "-C", str(ROOT)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(
        [*git, "status", "--porcelain", "honing"], capture_output=True, text=True
    )
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def save_results(name: str, report: dict, markdown, command: str, started: float, code: str):
    """``report`` with the machine, the revision ``code``, ``command`` and the wall time since
    ``started``, written as benchmarks/results/NAME.json and, as ``markdown(report)`` renders
    it, NAME.md (printed too)."""
    from benchmarks.moe import cpu_model

    report |= {
        "machine": f"{cpu_model()}, {os.cpu_count()} cores",
        "revision": code,
        "command": command,
        "wall_s": time.time() - started,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(report, indent=1))
    text = markdown(report)
    (RESULTS / f"{name}.md").write_text(text)
    print(text)


@contextlib.contextmanager
def held(lock: str):
    """Holds an exclusive ``flock`` on ``lock`` (nothing when empty): timing runs on a shared
    machine take turns."""
    if not lock:
        yield
        return
    with open(lock, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def compare(work: Workload, args: argparse.Namespace, threads: int) -> dict:
    """Alternating pairs of runs of ``work``; returns both systems' pooled figures."""
    model_dir = WORK / "models" / work.model.name
    data = peer_data(WORK, SEED)
    runs: dict[str, list[dict]] = {"trl": [], "honing": []}
    with held(args.lock):
        params = build_model_dir(work.model, model_dir, SEED)  # CPU-heavy: inside the lock
        for pair in range(work.pairs):
            order = ("trl", "honing") if pair % 2 == 0 else ("honing", "trl")
            for system in order:
                run_dir = WORK / "runs" / work.name / f"{pair}_{system}"
                if run_dir.exists():
                    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
                run_dir.mkdir(parents=True)
                if system == "trl":
                    result = run_trl(work, model_dir, run_dir, Path(args.peer_script))
                else:
                    result = run_honing(work, model_dir, data, run_dir, threads)
                runs[system].append(result)
                print(
                    f"[{work.name}] pair {pair} {system:6s} median step "
                    f"{result['median_step_s']:.3f} s, {result['completion_mean_length']:.1f} "
                    f"tokens/completion, peak RSS {result['peak_rss_mb']:.0f} MB",
                    flush=True,
                )
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    head = {"workload": asdict(work), "params": params, "vocab": vocab, "runs": runs}
    return head | pooled(runs)


def pooled(runs: dict[str, list[dict]]) -> dict:
    """Per system: median over all measured steps, stage medians, worst RSS; the ratio."""
    out = {}
    for system, results in runs.items():
        steps = [s for r in results for s in r["step_s"]]
        stages = {
            k: statistics.median([r["stages_s"][k] for r in results])
            for k in results[0]["stages_s"]
        }
        lengths = [r["completion_mean_length"] for r in results]
        median_step = statistics.median(steps)
        out[system] = {
            "median_step_s": median_step,
            "step_s_min_max": [min(steps), max(steps)],
            "completion_mean_length": statistics.median(lengths),
            "completion_tokens_per_s": statistics.median(lengths)
            * COMPLETIONS_PER_STEP
            / median_step,
            "stages_s": stages,
            "peak_rss_mb": max(r["peak_rss_mb"] for r in results),
        }
    pair_ratios = [
        t["median_step_s"] / h["median_step_s"]
        for t, h in zip(runs["trl"], runs["honing"], strict=True)
    ]
    out["ratio_trl_over_honing"] = out["trl"]["median_step_s"] / out["honing"]["median_step_s"]
    out["ratio_min_max_over_pairs"] = [min(pair_ratios), max(pair_ratios)]
    return out


def choose(args: argparse.Namespace) -> list[Workload]:
    """The workloads the flags select, with ``--pairs`` / ``--steps`` applied."""
    chosen = [w for w in WORKLOADS if args.full or w.name not in FULL_ONLY]
    if args.quick:
        chosen = [replace(w, pairs=1, steps=6) for w in chosen if w.model is PEER]
    if args.workloads:
        names = args.workloads.split(",")
        unknown = set(names) - {w.name for w in WORKLOADS}
        if unknown:
            sys.exit(f"unknown workloads {sorted(unknown)}; known: {[w.name for w in WORKLOADS]}")
        chosen = [w for w in WORKLOADS if w.name in names]
    return [replace(w, pairs=args.pairs or w.pairs, steps=args.steps or w.steps) for w in chosen]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", default="", help="comma-separated names; default all")
    parser.add_argument("--quick", action="store_true", help="peer workloads, 1 pair, 6 steps")
    parser.add_argument("--full", action="store_true", help=f"also {sorted(FULL_ONLY)}")
    parser.add_argument("--pairs", type=int, default=0, help="override every workload's pairs")
    parser.add_argument("--steps", type=int, default=0, help="override every workload's steps")
    parser.add_argument("--lock", default="", help="flock this file around each workload")
    parser.add_argument("--peer-script", default=str(PEER_SCRIPT))
    parser.add_argument("--tag", default="grpo_step", help="results file name")
    parser.add_argument("--report-only", action="store_true", help="rewrite the .md from .json")
    args = parser.parse_args(argv)
    if args.report_only:
        report = json.loads((RESULTS / f"{args.tag}.json").read_text())
        print(write_markdown(report, RESULTS / f"{args.tag}.md"))
        return
    if not PEERS_PYTHON.exists():
        sys.exit(f"{PEERS_PYTHON} is missing: run `make bench-setup` first")
    chosen = choose(args)
    import torch

    threads = torch.get_num_threads()  # torch's default here; TRL's is recorded per run
    words = [Path(sys.executable).name, "-m", "benchmarks.grpo_step", *(argv or sys.argv[1:])]
    report = {
        "command": " ".join(shlex.quote(word) for word in words),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
        "honing_threads": threads,
        "not_run": {n: r for n, r in FULL_ONLY.items() if n not in {w.name for w in chosen}},
        "workloads": [],
    }
    started = time.perf_counter()
    RESULTS.mkdir(parents=True, exist_ok=True)
    for work in chosen:  # the files are rewritten after each workload: a cut run keeps them
        report["workloads"].append(compare(work, args, threads))
        report["wall_s"] = time.perf_counter() - started
        (RESULTS / f"{args.tag}.json").write_text(json.dumps(report, indent=1))
        markdown = write_markdown(report, RESULTS / f"{args.tag}.md")
    print(markdown)


if __name__ == "__main__":
    main()
