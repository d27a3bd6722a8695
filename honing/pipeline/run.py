"""One training run end to end: run directory, resume, the loop, the closing summary.

Order matters for "nothing half-written": the config, data, model and the checkpoint to resume
from are all loaded (any bad input raises ``UserError``) before the first file is written.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from honing.checkpoint import CheckpointManager
from honing.checkpoint.disk import nearest_existing
from honing.config import Config, dump_yaml, to_dict
from honing.errors import UserError
from honing.host import configure_host
from honing.monitor import RunLogger
from honing.monitor.prometheus import check_port
from honing.monitor.report import write_report
from honing.pipeline.alerting import set_aside_newer
from honing.pipeline.components import Components, build_components
from honing.pipeline.loop import TrainLoop
from honing.pipeline.peers import Peers
from honing.pipeline.run_lock import RunLock
from honing.pipeline.state import CONFIG_FILE, adjustments, load_training_state


def default_output_dir(config_path: str | None) -> Path:
    name = Path(config_path).stem if config_path else "run"
    return Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def check_run_dir(run_dir: Path) -> None:
    """The run directory can be made and written: its nearest existing ancestor (or itself)
    is a writable directory. Checked before anything loads, so a bad ``--output-dir`` is one
    line and nothing is written."""
    probe = nearest_existing(run_dir)
    if not probe.is_dir():
        raise UserError(
            f"--output-dir {run_dir}: {probe} is a file, not a directory; "
            "choose another --output-dir"
        )
    for directory in (probe, probe / "checkpoints"):
        if directory.is_dir() and not os.access(directory, os.W_OK | os.X_OK):
            raise UserError(
                f"--output-dir {run_dir}: {directory} is not writable (read-only or not "
                "yours); choose another --output-dir, or copy the run somewhere writable "
                "and resume there"
            )


def _holds_run(run_dir: Path, checkpoints: CheckpointManager) -> bool:
    metrics = run_dir / "metrics.jsonl"
    return (metrics.exists() and metrics.stat().st_size > 0) or bool(checkpoints.complete_steps())


def flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out |= flat(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_changes(checkpoint: Path, config: Config) -> list[str]:
    """Keys whose value differs from the config the checkpoint was trained with."""
    saved = checkpoint / CONFIG_FILE
    if not saved.exists():
        return []
    before, now = flat(yaml.safe_load(saved.read_text())), flat(to_dict(config))
    return sorted(k for k in now if k in before and before[k] != now[k])


def checkpoint_manager(config: Config, run_dir: Path, on_event=None) -> CheckpointManager:
    """The run's checkpoint manager: ``RUN_DIR/checkpoints``, plus the mirror if configured."""
    settings = config.checkpoint
    return CheckpointManager(
        run_dir / "checkpoints",
        keep=settings.keep,
        mirror_url=settings.mirror_url,
        mirror_every=settings.mirror_every,
        mirror_keep=settings.mirror_keep,
        mirror_attempts=settings.mirror_retries + 1,
        on_event=on_event,
    )


def after_stop(config: Config, run_dir: Path) -> str:
    """What to do after Ctrl-C or SIGTERM stopped the run, for its last line: resume when the
    run directory holds a checkpoint (or a mirror may), else that none was written and how
    to keep one (``checkpoint.every``)."""
    try:
        steps = CheckpointManager(run_dir / "checkpoints", keep=1).complete_steps()
    except OSError:
        steps = []
    if steps or config.checkpoint.mirror_url:
        return "resume with --resume auto"
    every = config.checkpoint.every
    if every:
        return (
            f"no checkpoint was written yet (checkpoint.every={every}: the first at step "
            f"{every}), so --resume auto starts the run again from step 0"
        )
    return (
        "no checkpoint was written (checkpoint.every=0 saves only the last step), so "
        "--resume auto starts the run again from step 0; set checkpoint.every=N to keep one "
        "every N steps"
    )


class EventBuffer:
    """Holds the checkpoint manager's events until the run's logger exists, then forwards.

    Choosing the checkpoint to resume from happens before anything is written to the run
    directory, but what it found (a damaged checkpoint skipped) belongs in ``events.jsonl``.
    """

    def __init__(self) -> None:
        self.pending: list[tuple[str, dict]] = []
        self.sink: Callable[..., None] | None = None

    def __call__(self, kind: str, **fields) -> None:
        if self.sink is None:
            self.pending.append((kind, fields))
        else:
            self.sink(kind, **fields)

    def attach(self, sink: Callable[..., None]) -> None:
        """Sends the held events to ``sink``, and every later one straight there."""
        self.sink = sink
        for kind, fields in self.pending:
            sink(kind, **fields)
        self.pending.clear()


@dataclass
class Start:
    """What is settled before anything loads: the run directory's lock (held until
    ``release``), the checkpoint manager, the checkpoint to resume from (None: from scratch)
    and the events found while choosing it."""

    lock: RunLock
    checkpoints: CheckpointManager
    checkpoint: Path | None
    events: EventBuffer

    def release(self) -> None:
        """Lets the run directory go (the end of the run, or a failure before it)."""
        self.lock.release()


def prepare(config: Config, run_dir: Path, resume: str) -> Start:
    """What the run needs of the outside, checked before anything is written: the Prometheus
    port free, the run directory locked for this run alone, the mirror reachable; then the
    checkpoint to resume from (``--resume auto|never|PATH``). Each failure is a ``UserError``
    that leaves the run directory as it was (a damaged checkpoint, ``never`` into a directory
    that holds a run, another run writing it)."""
    if config.monitor.prometheus_port > 0:
        check_port(config.monitor.prometheus_port, config.monitor.prometheus_host)
    lock = RunLock(run_dir)
    leftover = lock.acquire()
    try:
        events = EventBuffer()
        if leftover is not None:  # its holder died without releasing it: the kernel did
            events("lock_taken_over", path=str(lock.path), previous=leftover)
        checkpoints = checkpoint_manager(config, run_dir, on_event=events)
        checkpoints.check_mirror()
        checkpoint = checkpoints.resolve(resume)
        if resume == "never" and _holds_run(run_dir, checkpoints):
            raise UserError(
                f"{run_dir} already holds a run; pass --resume auto to continue it, "
                "or choose another --output-dir"
            )
    except BaseException:
        lock.release()
        raise
    return Start(lock, checkpoints, checkpoint, events)


def stderr_log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def train_here(
    config: Config,
    run_dir: Path,
    resume: str = "auto",
    log=None,
    build: Callable[..., Components] | None = None,
) -> dict:
    """The whole run in this process: choose the checkpoint, build the parts (``build``:
    ``build_components``, or the Ray backend's, which swaps in its pools), train, close."""
    log = log or stderr_log
    start = prepare(config, run_dir, resume)
    try:
        configure_host(config.trainer.threads)
        torch.manual_seed(config.trainer.seed)
        parts = (build or build_components)(config, log)
        try:
            return run_training(config, run_dir, parts, start, log)
        finally:
            close(parts)
    finally:
        start.release()


def close(parts: Components) -> None:
    """Releases what the parts hold beyond this process (verifier pools, engines, workers)."""
    parts.scorer.close()
    parts.engine.close()


def run_training(
    config: Config,
    run_dir: Path,
    parts: Components,
    prepared: Start,
    log: Callable[[str], None],
    peers: Peers | None = None,
) -> dict:
    """Resume, write the run directory, run the loop (with ``peers``: the other torchrun
    ranks), write the summary; returns it."""
    checkpoints, checkpoint, events = prepared.checkpoints, prepared.checkpoint, prepared.events
    start, changed = 0, []
    if checkpoint is not None:
        changed = config_changes(checkpoint, config)
        start = load_training_state(parts, checkpoint, peers)
        log(f"resuming from {checkpoint} (step {start})")
        if changed:
            log(f"config differs from the checkpoint's in: {', '.join(changed)}")
    # Everything loaded: from here on the run directory is written.
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(run_dir / "config.yaml", dump_yaml(config))
    except OSError as err:  # a read-only mount, a full disk
        raise UserError(
            f"--output-dir {run_dir}: cannot write the run directory ({err.strerror or err}); "
            "choose another --output-dir"
        ) from None
    for leftover in checkpoints.cleanup_incomplete():
        log(f"removed an incomplete checkpoint left by a crash: {leftover}")
    abandoned = set_aside_newer(checkpoints, start, log)
    with RunLogger.from_config(
        run_dir,
        config.monitor,
        total_steps=config.trainer.total_steps,
        params=to_dict(config),
    ) as logger:
        events.attach(logger.log_event)
        if _holds_run(run_dir, checkpoints) or abandoned:
            # Steps after the resume point are redone; a fresh start redoes step 0 too.
            dropped = logger.truncate_after(start if start else -1)
            logger.log_event(
                "resumed" if start else "restarted",
                step=start,
                dropped=dropped,
                checkpoint=str(checkpoint) if checkpoint else None,
                config_changed=changed,
                abandoned=abandoned,
            )
        if parts.skipped_rows:
            logger.log_event("skipped_rows", count=parts.skipped_rows)
        if start >= config.trainer.total_steps:
            log(
                f"the run is already at step {start} of trainer.total_steps="
                f"{config.trainer.total_steps}; raise it to train further"
            )
        try:
            loop = TrainLoop(config, parts, logger, checkpoints, peers=peers)
            if checkpoint is not None:  # an alert rollback's settings, as the run had them
                loop.adjust(adjustments(checkpoint))
            loop.run(start)
        finally:  # trackers that keep files (W&B, MLflow) get the report, of a stopped run too
            logger.log_report(write_report)
            if mirrored := checkpoints.mirror_outcome():  # uploads that failed, or were cut off
                log(mirrored)
    result = summary(run_dir)
    try:
        write_atomic(run_dir / "summary.json", json.dumps(result, indent=1))
    except OSError as err:  # a full disk
        raise UserError(
            f"cannot write {run_dir / 'summary.json'} ({err.strerror or err}); the run is "
            "complete: free some space, then run it again with --resume auto for its summary"
        ) from None
    return result


def summary(run_dir: Path) -> dict:
    """First and last validation of the whole run, read back from metrics.jsonl (so resumed
    runs report from their true start). ``seconds`` counts training time: the sum of step and
    validation times, without start-up or time spent stopped."""
    lines = [
        json.loads(line)
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if line.strip()
    ]
    elapsed, curve = 0.0, []
    for m in sorted(lines, key=lambda m: m["step"]):
        elapsed += (m.get("timing_s/step") or 0.0) + (m.get("timing_s/val") or 0.0)
        if m.get("val/accuracy") is not None:
            curve.append(
                {
                    "step": m["step"],
                    "seconds": round(elapsed, 1),
                    **{k: v for k, v in m.items() if k.startswith("val/")},
                }
            )
    last_step = max((m["step"] for m in lines), default=0)
    # scores that failed on every try, left out of the validation rates (events.jsonl)
    errors = int(sum(m.get("val/score_errors") or 0 for m in lines))
    if not curve:  # no validation, or none that could score anything
        return {"run_dir": str(run_dir), "last_step": last_step, "val_score_errors": errors}
    first, last = curve[0], curve[-1]
    pass_key = next((k for k in first if k.startswith("val/pass@")), None)
    return {
        "run_dir": str(run_dir),
        "first_step": first["step"],
        "last_step": last["step"],
        "val_accuracy_start": first["val/accuracy"],
        "val_accuracy_end": last["val/accuracy"],
        "pass_at_k_key": pass_key,
        "pass_at_k_start": first.get(pass_key),
        "pass_at_k_end": last.get(pass_key),
        "seconds": last["seconds"],
        "val_score_errors": errors,
        "curve": curve,
    }
