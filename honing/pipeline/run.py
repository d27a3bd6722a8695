"""One training run end to end: run directory, resume, the loop, the closing summary."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from honing.checkpoint import CheckpointManager
from honing.config import Config, dump_yaml
from honing.errors import UserError
from honing.monitor import RunLogger
from honing.pipeline.components import build_components
from honing.pipeline.state import load_training_state
from honing.pipeline.sync import RunResult, SyncLoop


def default_output_dir(config_path: str | None) -> Path:
    name = Path(config_path).stem if config_path else "run"
    return Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def _has_logs(run_dir: Path) -> bool:
    return (run_dir / "metrics.jsonl").exists() and (run_dir / "metrics.jsonl").stat().st_size > 0


def train(config: Config, run_dir: Path, resume: str = "auto", log=None) -> RunResult:
    """Train per ``config`` into ``run_dir``; ``resume`` is auto, never or a checkpoint path."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    checkpoints = CheckpointManager(run_dir / "checkpoints", keep=config.checkpoint.keep)
    checkpoint = checkpoints.resolve(resume)
    if resume == "never" and _has_logs(run_dir):
        raise UserError(
            f"{run_dir} already holds a run; pass --resume auto to continue it, "
            "or choose another --output-dir"
        )
    if config.trainer.threads:
        torch.set_num_threads(config.trainer.threads)
    torch.manual_seed(config.trainer.seed)
    parts = build_components(config, log=log)  # everything that can fail on bad input first
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_yaml(config))
    start = 0
    for leftover in checkpoints.cleanup_incomplete():
        log(f"removed an incomplete checkpoint left by a crash: {leftover}")
    if checkpoint is not None:
        start = load_training_state(parts, checkpoint)
        log(f"resuming from {checkpoint} (step {start})")
        if start >= config.trainer.total_steps:
            log(
                f"the run is already at step {start} of trainer.total_steps="
                f"{config.trainer.total_steps}; raise it to train further"
            )
    with RunLogger(
        run_dir,
        total_steps=config.trainer.total_steps,
        tensorboard=config.monitor.tensorboard,
        console=config.monitor.console,
    ) as logger:
        if _has_logs(run_dir):
            dropped = logger.truncate_after(start)
            logger.log_event(
                "resumed" if start else "restarted",
                step=start,
                dropped=dropped,
                checkpoint=str(checkpoint) if checkpoint else None,
            )
        if parts.skipped_rows:
            logger.log_event("skipped_rows", count=parts.skipped_rows)
        result = SyncLoop(config, parts, logger, checkpoints, run_dir).run(start)
    (run_dir / "summary.json").write_text(json.dumps(summary(result), indent=1))
    return result


def summary(result: RunResult) -> dict:
    """First and last validation, and how long the run took to get there."""
    if not result.val_history:
        return {"run_dir": str(result.run_dir), "last_step": result.last_step}
    first, last = result.val_history[0], result.val_history[-1]
    pass_key = next((k for k in first[2] if k.startswith("val/pass@")), None)
    return {
        "run_dir": str(result.run_dir),
        "first_step": first[0],
        "last_step": last[0],
        "val_accuracy_start": first[2]["val/accuracy"],
        "val_accuracy_end": last[2]["val/accuracy"],
        "pass_at_k_key": pass_key,
        "pass_at_k_start": first[2].get(pass_key),
        "pass_at_k_end": last[2].get(pass_key),
        "seconds": last[1],
        "curve": [
            {"step": s, "seconds": round(t, 1), "val/accuracy": m["val/accuracy"]}
            for s, t, m in result.val_history
        ],
    }
