"""Mixture-of-experts measurements on builtin:tiny-moe (examples/arithmetic_moe.yaml).

    .venv/bin/python -m benchmarks.moe replay --steps 24   # routing mismatch, off / R2 / R3
    .venv/bin/python -m benchmarks.moe paired --batches 20 # the same batches, off vs R3
    .venv/bin/python -m benchmarks.moe learn               # GRPO vs GSPO, R3 on and off
    .venv/bin/python -m benchmarks.moe speed --rounds 3    # MoE fast paths vs HF forward

``replay``: under ``schedule.mode=one_step`` (rollouts one version behind) and under
``trainer.autocast=bfloat16`` (the trainer's passes in bf16, generation in float32), each with
``algorithm.routing_replay`` off, R2 and R3: the medians over the steps of
``moe/rollout_router_match`` and ``rollout_mismatch/kl`` (two PPO epochs, so that the old
pass runs and R2 has passes to replay into); each run follows its own trajectory.
``paired``: the same rollouts scored by the trainer with replay off and with R3, so that
nothing but the replay differs: per batch of 16 prompts x 8 samples from the float32 engine,
(a) the trainer's pass under bf16 autocast and (b) the pass of the policy one update later
(a GRPO step at lr 1e-4 on that batch: what one_step trains on); medians over the batches of
the router match and the k3 KL to the behaviour logprobs. ``learn``: the example's budget
for each of GRPO (ppo_clip) and GSPO, with R3 and without; greedy validation accuracy at
the start and the end and the wall time (one seed). ``speed``: the example's steps with the
lean paths (rollout.fast_decode, trainer.packed_forward) on and off, alternating; medians
of the generation and update seconds. Each writes benchmarks/results/moe_<command>.json and .md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
CONFIG = "examples/arithmetic_moe.yaml"


def train(overrides: list[str]) -> tuple[list[dict], dict, float]:
    """One ``honing train`` of the example with ``overrides``: its step records, summary and
    wall seconds."""
    with tempfile.TemporaryDirectory() as workdir:
        run = Path(workdir) / "run"
        started = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "honing.cli", "train", CONFIG, *overrides]
            + ["--output-dir", str(run), "--resume", "never", "monitor.console=false"],
            check=True,
            cwd=ROOT,
        )
        wall = time.perf_counter() - started
        lines = (run / "metrics.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines]
        summary = json.loads((run / "summary.json").read_text())
    return [r for r in records if "actor/pg_loss" in r], summary, wall


def median(records: list[dict], key: str) -> float | None:
    values = [r[key] for r in records if isinstance(r.get(key), (int, float))]
    return statistics.median(values) if values else None


def replay(args) -> dict:
    scenarios = {
        "one_step": ["schedule.mode=one_step"],
        "bf16 autocast": ["trainer.autocast=bfloat16"],
    }
    quick = [
        f"trainer.total_steps={args.steps}",
        "trainer.val_every=0",
        "trainer.val_at_start=false",
        "trainer.ppo_epochs=2",
        "checkpoint.every=0",
    ]
    rows = []
    for scenario, overrides in scenarios.items():
        for mode in ("off", "R2", "R3"):
            steps, _, wall = train(quick + overrides + [f"algorithm.routing_replay={mode}"])
            row = {
                "scenario": scenario,
                "routing_replay": mode,
                "steps": len(steps),
                "router_match": median(steps, "moe/rollout_router_match"),
                "mismatch_kl": median(steps, "rollout_mismatch/kl"),
                "ppo_kl": median(steps, "actor/ppo_kl"),
                "clipfrac": median(steps, "actor/pg_clipfrac"),
                "wall_s": round(wall, 1),
            }
            rows.append(row)
            print(row, flush=True)
    lines = [
        "| scenario | routing_replay | steps | moe/rollout_router_match | rollout_mismatch/kl "
        "| actor/ppo_kl | actor/pg_clipfrac |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['scenario']} | {r['routing_replay']} | {r['steps']} | {r['router_match']:.4f} "
        f"| {r['mismatch_kl']:.2e} | {r['ppo_kl']:.2e} | {r['clipfrac']:.4f} |"
        for r in rows
    ]
    return {"rows": rows, "table": lines}


def paired(args) -> dict:
    import copy

    import torch

    from honing.algorithms import get_advantage
    from honing.algorithms.mismatch import mismatch_metrics
    from honing.config import build_config
    from honing.data.arithmetic import arithmetic_prompts
    from honing.models.loading import load_causal_lm, load_tokenizer
    from honing.models.moe import routers_of
    from honing.models.moe_stats import RouterStats, host_sums, moe_metrics
    from honing.models.tiny import TINY_MOE
    from honing.pipeline.components import builtin_tiny_model, cache_dir, resolve_model_path
    from honing.rollout.base import GenerationRequest, SamplingParams
    from honing.rollout.native.engine import TransformersEngine
    from honing.trainer.batch import RouterTap, collate, response_logprobs
    from honing.trainer.engine import TrainedModule
    from honing.trainer.layouts import OneProcess
    from honing.trainer.policy_update import UpdateSettings, update_policy

    torch.manual_seed(0)
    config = build_config({"model.path": "builtin:tiny-moe"})
    if args.family == "qwen3_moe":
        path = resolve_model_path(config)
    else:  # the same shape and warm start in another family's architecture
        spec = dataclasses.replace(TINY_MOE, family=args.family)
        path = builtin_tiny_model(cache_dir(config), spec=spec)
    tokenizer = load_tokenizer(path)
    model = load_causal_lm(path, tokenizer, dtype="float32", device="cpu")
    routers = routers_of(model)
    prompts = arithmetic_prompts("train", 16 * args.batches, seed=1, max_digits=2)
    engine = TransformersEngine(model, tokenizer, device=torch.device("cpu"))
    sampling = SamplingParams(n=8, max_new_tokens=4, temperature=1.0, max_seq_len=64)

    def measure(policy, batch, replay: bool, bf16: bool, affected=None) -> dict:
        """Router match and k3 KL to the behaviour logprobs of the trainer's pass; with
        ``record`` (no ``affected`` yet), also which response tokens the live routing
        changes: those with a differing decision at their input or an earlier position."""
        batch.replay = batch.rollout_routing if replay else None
        tap = RouterTap(stats=RouterStats(), record=affected is None)
        context = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else _nothing()
        with torch.no_grad(), context:
            logprobs, _ = response_logprobs(policy, batch, packed=True, tap=tap)
        stats = host_sums(tap.stats.sums())
        if affected is None:
            plan = batch.rollout_routing
            differs = (tap.recorded.sort(-1).values != plan.sort(-1).values).flatten(2).any(-1)
            differs &= plan[:, :, 0, 0] >= 0
            width, start = batch.responses.shape[1], batch.prompt_width - 1
            seen = differs.cumsum(-1) > 0  # [B, P + R]: a differing decision so far
            affected = seen[:, start : start + width] & batch.response_mask.bool()
        mask = batch.response_mask
        kl = mismatch_metrics(logprobs.float(), batch.behaviour_logprobs, mask)
        kl_affected = mismatch_metrics(logprobs.float(), batch.behaviour_logprobs, affected)
        match = moe_metrics(stats, routers.layers, routers.num_experts)
        return {
            "match": match["moe/rollout_router_match"],
            "kl": float(kl["rollout_mismatch/kl"]),
            "kl_affected": float(kl_affected["rollout_mismatch/kl"]) if affected.any() else None,
            "affected_share": float(affected.sum() / mask.sum()),
            "affected": affected,
        }

    values: dict[tuple[str, str], list[dict]] = {}
    for number in range(args.batches):
        chunk = prompts[16 * number : 16 * (number + 1)]
        requests = [
            GenerationRequest(p.id, tokenizer.encode(p.prompt, add_special_tokens=False), i)
            for i, p in enumerate(chunk)
        ]
        sampling = dataclasses.replace(sampling, seed=number)
        model.eval()
        rollouts = engine.generate(requests, sampling)
        batch = collate(rollouts, tokenizer.pad_token_id, torch.device("cpu"))
        scores = torch.tensor(
            [float(r.text.strip() == chunk[r.group_index].ground_truth) for r in rollouts]
        )
        groups = torch.tensor([r.group_index for r in rollouts])
        advantages, _ = get_advantage("grpo")(scores, batch.response_mask, groups)
        later = copy.deepcopy(model)
        trainer = TrainedModule(
            "policy", later, torch.optim.AdamW(later.parameters(), lr=1e-4), layout=OneProcess()
        )
        update_policy(trainer, batch, advantages, UpdateSettings())
        later.eval()
        for scenario, policy, bf16 in (
            ("bf16 autocast", model, True),
            ("one update later", later, False),
        ):
            live = measure(policy, batch, False, bf16)
            replayed = measure(policy, batch, True, bf16, affected=live["affected"])
            values.setdefault((scenario, "off"), []).append(live)
            values.setdefault((scenario, "R3"), []).append(replayed)
    rows = []
    for (scenario, mode), runs in values.items():
        with_affected = [r["kl_affected"] for r in runs if r["kl_affected"] is not None]
        rows.append(
            {
                "scenario": scenario,
                "routing_replay": mode,
                "batches": len(runs),
                "router_match": statistics.median(r["match"] for r in runs),
                "mismatch_kl": statistics.median(r["kl"] for r in runs),
                "affected_share": statistics.median(r["affected_share"] for r in runs),
                "kl_affected": statistics.fmean(with_affected) if with_affected else None,
                "kl_mean": statistics.fmean(r["kl"] for r in runs),
            }
        )
    lines = [
        "| scenario | routing_replay | batches | router match | KL, all tokens (median) "
        "| KL, all tokens (mean) | tokens the live routing changes | KL on those (mean) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['scenario']} | {r['routing_replay']} | {r['batches']} | {r['router_match']:.4f} "
        f"| {r['mismatch_kl']:.3e} | {r['kl_mean']:.3e} | {100 * r['affected_share']:.1f}% | "
        + ("" if r["kl_affected"] is None else f"{r['kl_affected']:.3e}")
        + " |"
        for r in rows
    ]
    return {"rows": rows, "table": lines}


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def learn(args) -> dict:
    rows = []
    for loss in ("ppo_clip", "gspo"):
        for mode in ("off", "R3"):
            overrides = [f"algorithm.policy_loss={loss}", f"algorithm.routing_replay={mode}"]
            if args.off_policy:  # four optimizer steps per batch: the ratios leave 1
                overrides += ["trainer.mini_batch_size=8", "trainer.ppo_epochs=2"]
            if args.steps:
                overrides.append(f"trainer.total_steps={args.steps}")
            _, summary, wall = train(overrides)
            curve = {point["step"]: point["val/accuracy"] for point in summary["curve"]}
            row = {
                "policy_loss": loss,
                "routing_replay": mode,
                "val_accuracy_at": {step: curve.get(step) for step in (50, 100, 200)},
                "val_accuracy_start": summary["val_accuracy_start"],
                "val_accuracy_end": summary["val_accuracy_end"],
                "gain_points": round(
                    100 * (summary["val_accuracy_end"] - summary["val_accuracy_start"]), 1
                ),
                "train_s": round(summary["seconds"], 1),
                "wall_s": round(wall, 1),
            }
            rows.append(row)
            print(row, flush=True)
    lines = [
        "| policy loss | routing_replay | val/accuracy start → end | at step 50 / 100 / 200 "
        "| gain | training s |",
        "|---|---|---|---|---:|---:|",
    ]
    lines += [
        f"| {r['policy_loss']} | {r['routing_replay']} | {r['val_accuracy_start']:.3f} → "
        f"{r['val_accuracy_end']:.3f} | "
        + " / ".join(f"{v:.3f}" for v in r["val_accuracy_at"].values() if v is not None)
        + f" | {r['gain_points']:+.1f} | {r['train_s']:.0f} |"
        for r in rows
    ]
    return {"rows": rows, "table": lines}


def speed(args) -> dict:
    quick = [
        f"trainer.total_steps={args.steps}",
        "trainer.val_every=0",
        "trainer.val_at_start=false",
        "checkpoint.every=0",
    ]
    paths = {
        "lean paths": ["rollout.fast_decode=true", "trainer.packed_forward=true"],
        "model's own forward": ["rollout.fast_decode=false", "trainer.packed_forward=false"],
    }
    samples: dict[str, dict[str, list[float]]] = {
        name: {"gen": [], "update": [], "step": []} for name in paths
    }
    for _ in range(args.rounds):  # alternating, so drift affects both alike
        for name, overrides in paths.items():
            steps, _, _ = train(quick + overrides)
            for key in ("gen", "update", "step"):
                samples[name][key] += [r[f"timing_s/{key}"] for r in steps[1:]]
    medians = {
        name: {key: statistics.median(values) for key, values in parts.items()}
        for name, parts in samples.items()
    }
    lean, own = medians["lean paths"], medians["model's own forward"]
    lines = ["| path | generation s | update s | step s |", "|---|---:|---:|---:|"]
    lines += [
        f"| {name} | {m['gen']:.3f} | {m['update']:.3f} | {m['step']:.3f} |"
        for name, m in medians.items()
    ]
    lines.append(
        f"| ratio (own / lean) | {own['gen'] / lean['gen']:.2f} | "
        f"{own['update'] / lean['update']:.2f} | {own['step'] / lean['step']:.2f} |"
    )
    return {"medians": medians, "table": lines}


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=("replay", "paired", "learn", "speed"))
    parser.add_argument("--steps", type=int, default=0, help="steps per run (0: command default)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument(
        "--family",
        choices=("qwen3_moe", "gpt_oss"),
        default="qwen3_moe",
        help="paired: builtin:tiny-moe's architecture (gpt_oss: the same shape and warm start)",
    )
    parser.add_argument(
        "--off-policy", action="store_true", help="learn: 2 mini-batches x 2 epochs per batch"
    )
    args = parser.parse_args()
    args.steps = args.steps or {"replay": 24, "paired": 0, "learn": 0, "speed": 12}[args.command]
    started = time.perf_counter()
    result = {"replay": replay, "paired": paired, "learn": learn, "speed": speed}[args.command](
        args
    )
    options = {
        "replay": f"--steps {args.steps}",
        "paired": f"--batches {args.batches}"
        + (f" --family {args.family}" if args.family != "qwen3_moe" else ""),
        "learn": (f"--steps {args.steps}" if args.steps else "")
        + (" --off-policy" if args.off_policy else ""),
        "speed": f"--steps {args.steps} --rounds {args.rounds}",
    }[args.command]
    result |= {
        "command": " ".join(f"python -m benchmarks.moe {args.command} {options}".split()),
        "config": CONFIG
        if args.family == "qwen3_moe"
        else f"builtin:tiny-moe's shape and warm start, as {args.family}",
        "machine": f"{cpu_model()}, {os.cpu_count()} cores",
        "seconds": round(time.perf_counter() - started, 1),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = f"moe_{args.command}" + ("_off_policy" if args.off_policy else "")
    name += f"_{args.family}" if args.family != "qwen3_moe" else ""
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=1))
    header = f"`{result['command']}` on {result['machine']} ({result['config']}, one seed)\n\n"
    (RESULTS / f"{name}.md").write_text(header + "\n".join(result["table"]) + "\n")
    print("\n".join(result["table"]))


if __name__ == "__main__":
    main()
