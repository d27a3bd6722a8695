"""A planted collapse on the demo: from step K the learning rate is 100x too high.

Two runs of `examples/arithmetic.yaml` (builtin tiny model, same seed), with the plant:

- ``rollback``: alert rules watch the policy; when they fire, the run rolls back to the last
  checkpoint before the collapse with ``lr_scale=0.01`` (undoing the bad factor) and goes on;
  the measure is validation accuracy at the end vs just before the plant (target: within 5
  points);
- ``stop``: the same rules with ``stop``: the run ends with exit status 3 and a checkpoint.

The plant multiplies the scheduler's factor by 100 for steps >= K (as a mistyped learning
rate from a config change would); it stays in force after a rollback, so only the rollback's
own ``lr_scale`` brings the run back.

Usage: python benchmarks/planted_collapse.py [--steps 150] [--plant-at 60]
Writes benchmarks/results/planted_collapse.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import honing.pipeline.components as components  # noqa: E402
from honing.backends.launch import train  # noqa: E402
from honing.config import resolve_config  # noqa: E402
from honing.errors import RunStopped  # noqa: E402

RULES = [
    "actor/entropy < 0.05 for 2 steps -> {action}",
    "critic/score/mean falls 4 -> {action}",
    "val/accuracy < 0.6 -> {action}",
]


def plant(at_step: int, factor: float = 100.0) -> None:
    """Make every scheduler built from now on multiply its lr by ``factor`` from ``at_step``."""
    build = components.build_components

    def planted(config, log=print):
        parts = build(config, log=log)
        scheduler = parts.trainers.policy.scheduler
        original = list(scheduler.lr_lambdas)
        scheduler.lr_lambdas = [
            (lambda step, fn=fn: fn(step) * (factor if step + 1 >= at_step else 1.0))
            for fn in original
        ]
        return parts

    components.build_components = planted
    import honing.pipeline.run as run_module

    run_module.build_components = planted


def run(action: str, steps: int, out: Path) -> dict:
    rules = [
        rule.format(action=action + ("(lr_scale=0.01)" if action == "rollback" else ""))
        for rule in RULES
    ]
    config = resolve_config(
        str(ROOT / "examples" / "arithmetic.yaml"),
        [
            f"trainer.total_steps={steps}",
            "trainer.val_every=10",
            "checkpoint.every=10",
            "checkpoint.keep=20",
            "monitor.console=false",
            f"monitor.alerts={json.dumps(rules)}",
        ],
    )
    start = time.perf_counter()
    status = "completed"
    try:
        train(config, out, resume="never", log=lambda message: None)
    except RunStopped as stop:
        status = f"stopped: {stop}"
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    val = {m["step"]: m["val/accuracy"] for m in metrics if m.get("val/accuracy") is not None}
    return {
        "action": action,
        "status": status,
        "seconds": round(time.perf_counter() - start, 1),
        "val_accuracy": val,
        "events": [
            e for e in events if e["kind"] in ("alert", "rollback", "rollback_refused", "stopped")
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--plant-at", type=int, default=60)
    parser.add_argument("--out", type=Path, default=Path("/tmp/planted_collapse"))
    args = parser.parse_args()
    plant(args.plant_at)
    results = [run(action, args.steps, args.out / action) for action in ("rollback", "stop")]
    before = max(s for s in results[0]["val_accuracy"] if s < args.plant_at)
    report = {"steps": args.steps, "plant_at": args.plant_at, "rules": RULES, "runs": results}
    pre = results[0]["val_accuracy"][before]
    end = results[0]["val_accuracy"][max(results[0]["val_accuracy"])]
    report["rollback_pre_collapse_accuracy"] = pre
    report["rollback_final_accuracy"] = end
    target = ROOT / "benchmarks" / "results"
    (target / "planted_collapse.json").write_text(json.dumps(report, indent=1) + "\n")
    lines = [
        f"# Planted collapse: lr x100 from step {args.plant_at} (demo config, {args.steps} steps)",
        "",
        "Rules: " + "; ".join(f"`{r.format(action='ACTION')}`" for r in RULES),
        "",
    ]
    for result in results:
        lines.append(f"## {result['action']}: {result['status']} ({result['seconds']} s)")
        lines.append("")
        lines.append(
            "val/accuracy by step: "
            + ", ".join(f"{s}: {v:.3f}" for s, v in result["val_accuracy"].items())
        )
        lines.append("")
        for event in result["events"]:
            fields = {
                k: v
                for k, v in event.items()
                if k in ("kind", "step", "rule", "to_step", "good_step", "reason")
            }
            lines.append(f"- {fields}")
        lines.append("")
    lines.append(
        f"Rollback run: val/accuracy {pre:.3f} at step {before} (last validation before the plant) "
        f"-> {end:.3f} at the end ({100 * (end - pre):+.1f} points)."
    )
    (target / "planted_collapse.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
