"""The run directory's logs: metrics, samples and events, fanned out to their sinks.

    RUN_DIR/metrics.jsonl   one object per step: {"step", metric names..., "time"}
    RUN_DIR/samples.jsonl   one object per logged generation, with its "step"
    RUN_DIR/events.jsonl    {"time", "kind", ...}: alerts, restarts, skipped steps
    RUN_DIR/tensorboard/    TensorBoard event files (optional)

Reopening an existing run directory appends; ``truncate_after`` removes the steps a resumed
run is about to redo, so no step appears twice.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self, TextIO

from honing.monitor.console import ConsoleSink
from honing.monitor.sinks import JsonlSink, MetricSink, TensorBoardSink

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
EVENTS_FILE = "events.jsonl"
TENSORBOARD_DIR = "tensorboard"


def aggregate(values: dict[str, list[float]]) -> dict[str, float]:
    """Averages each metric's list of values (e.g. over the micro-batches of one step).

    Args:
        values: Metric name -> values collected during the step.

    Returns:
        Metric name -> arithmetic mean. Names with an empty list are left out (the mean of
        nothing is not a number); a NaN among the values makes the mean NaN, on purpose.
    """
    return {name: math.fsum(items) / len(items) for name, items in values.items() if items}


class RunLogger:
    """Owns the log files of one run directory and fans metrics out to the sinks.

    Args:
        run_dir: The run directory; created if missing.
        total_steps: Last step of the run, for the console's progress bar and ETA.
        tensorboard: Also write TensorBoard event files under ``run_dir/tensorboard``.
        console: Also print one summary line per step.
        stream: Console stream; ``None`` means ``sys.stderr``.
        sinks: Further metric sinks (e.g. a Prometheus exporter); closed with the logger.
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        total_steps: int,
        tensorboard: bool = True,
        console: bool = True,
        stream: TextIO | None = None,
        sinks: Sequence[MetricSink] = (),
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._metrics = JsonlSink(self.run_dir / METRICS_FILE)
        self._samples = JsonlSink(self.run_dir / SAMPLES_FILE)
        self._events = JsonlSink(self.run_dir / EVENTS_FILE)
        self._tensorboard = TensorBoardSink(self.run_dir / TENSORBOARD_DIR) if tensorboard else None
        self._console = ConsoleSink(total_steps, stream=stream) if console else None
        optional: list[MetricSink] = [
            sink for sink in (self._tensorboard, self._console) if sink is not None
        ]
        self.sinks: list[MetricSink] = [self._metrics, *optional, *sinks]

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        """Writes one step's metrics to every sink."""
        for sink in self.sinks:
            sink.write(step, metrics)

    def log_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        """Appends each sample to ``samples.jsonl`` as ``{"step": step, **sample}``."""
        self._samples.append({"step": step, **sample} for sample in samples)

    def log_event(self, kind: str, **fields: Any) -> None:
        """Appends ``{"time", "kind", **fields}`` to ``events.jsonl``; echoes it on the console.

        Args:
            kind: What happened, e.g. ``"alert"``, ``"restart"``, ``"skipped_step"``.
            **fields: Details; any JSON-able values (non-finite floats become null).
        """
        self._events.append([{"time": time.time(), "kind": kind, **fields}])
        if self._console is not None:
            details = " ".join(f"{key}={value}" for key, value in fields.items())
            self._console.note(f"[{kind}] {details}".rstrip())

    def truncate_after(self, step: int) -> dict[str, int]:
        """Forgets logged steps after ``step``, before a resumed run redoes them.

        Drops the lines of ``metrics.jsonl`` and ``samples.jsonl`` with a greater step
        (rewritten through a temporary file and ``os.replace``); ``events.jsonl`` is history
        and kept whole. TensorBoard gets a restart marker, so it hides its later points.

        Args:
            step: The step of the checkpoint the run resumes from.

        Returns:
            File name -> number of lines dropped.
        """
        dropped = {
            METRICS_FILE: self._metrics.truncate_after(step),
            SAMPLES_FILE: self._samples.truncate_after(step),
        }
        if self._tensorboard is not None:
            self._tensorboard.mark_restart(step)
        return dropped

    def close(self) -> None:
        """Closes every sink and log file."""
        for sink in self.sinks:
            sink.close()
        self._samples.close()
        self._events.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
