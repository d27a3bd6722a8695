"""The run directory's logs: metrics, samples and events, fanned out to their sinks.

    RUN_DIR/metrics.jsonl   one object per step: {"step", metric names..., "time"}
    RUN_DIR/samples.jsonl   one object per logged generation, with its "step"
    RUN_DIR/events.jsonl    {"time", "kind", ...}: alerts, restarts, skipped steps
    RUN_DIR/tensorboard/    TensorBoard event files (optional)

The other destinations (console, TensorBoard, Prometheus, W&B, MLflow) are sinks built by
name from the config (``RunLogger.from_config``, see ``honing.monitor.registry``).

Reopening an existing run directory appends; ``truncate_after`` removes the steps a resumed
run is about to redo, so no step appears twice.

A full disk under any sink (the log files, TensorBoard's, a tracker's local store) ends the
run with one line, the same as a checkpoint that finds no room (``sinks.cannot_write``,
``UserError``): a sink's own error that says ``ENOSPC`` is turned into it here. An event that
another thread (the alert watchdog, a webhook's) cannot write is raised on the run's own
thread, at its next call to the logger.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self, TextIO

from honing.errors import UserError
from honing.monitor.console import ConsoleSink
from honing.monitor.names import known_metric
from honing.monitor.registry import TENSORBOARD_DIR, SinkContext, build_sinks
from honing.monitor.sinks import JsonlSink, MetricSink, no_room, says_no_room
from honing.monitor.tensorboard_sink import TensorBoardSink

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
EVENTS_FILE = "events.jsonl"
SUMMARY_QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9)


def aggregate(values: dict[str, list[float]]) -> dict[str, float]:
    """Averages each metric's list of values (e.g. over the micro-batches of one step).

    Args:
        values: Metric name -> values collected during the step.

    Returns:
        Metric name -> arithmetic mean. Names with an empty list are left out (the mean of
        nothing is not a number); a NaN among the values makes the mean NaN, on purpose.
    """
    return {name: math.fsum(items) / len(items) for name, items in values.items() if items}


def quantile(ordered: Sequence[float], fraction: float) -> float:
    """The ``fraction`` quantile of sorted values, interpolating linearly between ranks."""
    position = fraction * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def distribution_metrics(name: str, values: Sequence[float]) -> dict[str, float]:
    """A step's distribution as metrics: ``name/min``, ``name/p10`` ... ``name/p90``, ``name/max``.

    The percentiles of the step's values go to ``metrics.jsonl`` with the other metrics, so
    the HTML report can draw the distribution over time (bands) without TensorBoard.
    Non-finite values are left out; no finite value gives an empty dict.

    Args:
        name: Metric family, e.g. ``"response_length"`` or ``"critic/score"``.
        values: The step's values.
    """
    ordered = sorted(float(v) for v in values if math.isfinite(float(v)))
    if not ordered:
        return {}
    summary = {f"{name}/min": ordered[0]}
    for fraction in SUMMARY_QUANTILES:
        summary[f"{name}/p{round(fraction * 100)}"] = quantile(ordered, fraction)
    summary[f"{name}/max"] = ordered[-1]
    return summary


class RunLogger:
    """Owns the log files of one run directory and fans metrics out to the sinks.

    Args:
        run_dir: The run directory; created if missing.
        total_steps: Last step of the run, for the console's progress bar and ETA.
        tensorboard: Also write TensorBoard event files under ``run_dir/tensorboard``.
        console: Also print one summary line per step.
        stream: Console stream; ``None`` means ``sys.stderr``.
        sinks: Further metric sinks (e.g. a Prometheus exporter); closed with the logger.
            ``RunLogger.from_config`` builds them all from the config instead.
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
        self._event_lock = threading.Lock()
        self._owner = threading.get_ident()  # the run's thread: other threads' errors wait for it
        self._thread_error: UserError | None = None
        optional: list[MetricSink] = []
        if tensorboard:
            optional.append(TensorBoardSink(self.run_dir / TENSORBOARD_DIR))
        if console:
            optional.append(ConsoleSink(total_steps, stream=stream))
        self.sinks: list[MetricSink] = [self._metrics, *optional, *sinks]
        self._check_names = os.environ.get("HONING_CHECK_METRIC_NAMES") == "1"

    @classmethod
    def from_config(
        cls,
        run_dir: str | Path,
        monitor: Any,
        *,
        total_steps: int,
        stream: TextIO | None = None,
        params: Mapping[str, Any] | None = None,
    ) -> RunLogger:
        """A logger with every sink the ``monitor`` config section switches on.

        Args:
            run_dir: The run directory; created if missing.
            monitor: The config's ``monitor`` section (keys read by attribute, with defaults).
            total_steps: Last step of the run.
            stream: Console stream; ``None`` means ``sys.stderr``.
            params: The resolved config as nested dicts (run parameters for W&B / MLflow).

        Raises:
            ConfigError: A configured sink's package is missing, or its settings cannot be
                honoured (e.g. the Prometheus port is taken). Nothing is left running.
            UserError: A sink finds the disk full as it starts (``cannot_write``).
        """
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        context = SinkContext(run_dir, total_steps, monitor, stream, dict(params or {}))
        try:
            sinks = build_sinks(context)
        except Exception as err:
            if not says_no_room(err):
                raise
            raise no_room(err, run_dir) from None
        try:
            return cls(
                run_dir, total_steps=total_steps, tensorboard=False, console=False, sinks=sinks
            )
        except BaseException:
            for sink in sinks:
                sink.close()
            raise

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        """Writes one step's metrics to every sink. Under ``HONING_CHECK_METRIC_NAMES=1``
        (the tests) a name that ``monitor.names`` does not know is an error: alert rules are
        checked against that list."""
        if self._check_names:
            unknown = sorted(name for name in metrics if not known_metric(name))
            if unknown:
                raise ValueError(f"metrics missing from honing/monitor/names.py: {unknown}")
        self._to_sinks("write", step, metrics)

    def log_histograms(self, step: int, histograms: Mapping[str, Sequence[float]]) -> None:
        """Records value distributions of one step, e.g. rewards and response lengths.

        Call it before the step's ``log_metrics``, which flushes what it wrote.

        Passes the values to every sink with a ``write_histograms`` method (TensorBoard,
        W&B); other sinks ignore histograms. For percentiles in ``metrics.jsonl``, add
        ``distribution_metrics`` to the step's metrics.

        Args:
            step: The training step.
            histograms: Name -> the step's values (a list, array or CPU tensor), e.g.
                ``{"critic/score": rewards, "response_length": lengths}``.
        """
        self._to_sinks("write_histograms", step, histograms)

    def log_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        """Appends each sample to ``samples.jsonl`` as ``{"step": step, **sample}``."""
        self._raise_thread_error()
        self._samples.append({"step": step, **sample} for sample in samples)

    def _to_sinks(self, method: str, *args: Any) -> None:
        """Calls ``method`` of every sink that has it; a full disk under one is the run's one
        line (``cannot_write``)."""
        self._raise_thread_error()
        for sink in self.sinks:
            call = getattr(sink, method, None)
            if call is None:
                continue
            try:
                call(*args)
            except Exception as err:
                if not says_no_room(err):
                    raise
                raise no_room(err, self._store_of(sink)) from None

    def _store_of(self, sink: object) -> Path:
        """Where a sink keeps its files, for a full disk's message: its ``local_path`` (a
        tracker's local store), else the run directory."""
        return getattr(sink, "local_path", None) or self.run_dir

    def _raise_thread_error(self) -> None:
        """Raises, on the run's thread, an event another thread could not write."""
        if self._thread_error is not None and threading.get_ident() == self._owner:
            error, self._thread_error = self._thread_error, None
            raise error

    def log_event(self, kind: str, **fields: Any) -> None:
        """Appends ``{"time", "kind", **fields}`` to ``events.jsonl``; echoes it on the console.

        Args:
            kind: What happened, e.g. ``"alert"``, ``"restart"``, ``"skipped_step"``.
            **fields: Details; any JSON-able values (non-finite floats become null).

        Safe to call from other threads (the alert watchdog, webhook failures): one event is
        written whole before the next. An event another thread cannot write (a full disk)
        raises nothing there: its ``UserError`` is raised on the run's own thread, by its next
        call to the logger.
        """
        self._raise_thread_error()
        details = " ".join(f"{key}={value}" for key, value in fields.items())
        with self._event_lock:
            try:
                self._events.append([{"time": time.time(), "kind": kind, **fields}])
            except UserError as error:
                if threading.get_ident() == self._owner:
                    raise
                self._thread_error = self._thread_error or error
                return
            for sink in self.sinks:
                note = getattr(sink, "note", None)
                if note is not None:
                    note(f"[{kind}] {details}".rstrip())

    def log_report(self, write: Callable[[Path], Path]) -> Path | None:
        """Writes the run's report and hands the file to the sinks that keep files.

        Only when a sink has a ``log_report`` method (W&B, MLflow): then ``write(run_dir)``
        (``honing.monitor.report.write_report``) writes the report and each such sink gets
        its path. A report that cannot be written or kept is a ``report_failed`` event, never
        a training error: the metrics are already logged.

        Returns:
            The report's path, or ``None`` when no sink takes one or it could not be written.
        """
        takers = [(type(sink).__name__, getattr(sink, "log_report", None)) for sink in self.sinks]
        takers = [(name, log_report) for name, log_report in takers if log_report is not None]
        if not takers:
            return None
        try:
            path = write(self.run_dir)
        except Exception as error:
            self.log_event("report_failed", error=f"{type(error).__name__}: {error}")
            return None
        for name, log_report in takers:
            try:
                log_report(path)
            except Exception as error:  # a tracker that is down or refuses the upload
                self.log_event("report_failed", sink=name, error=f"{type(error).__name__}: {error}")
        return path

    def truncate_after(self, step: int) -> dict[str, int]:
        """Forgets logged steps after ``step``, before a resumed run redoes them.

        Drops the lines of ``metrics.jsonl`` and ``samples.jsonl`` with a greater step
        (rewritten through a temporary file and ``os.replace``); ``events.jsonl`` is history
        and kept whole. Sinks with a ``mark_restart`` method (TensorBoard) get a restart
        marker, so they hide their later points.

        Args:
            step: The step of the checkpoint the run resumes from.

        Returns:
            File name -> number of lines dropped.
        """
        dropped = {
            METRICS_FILE: self._metrics.truncate_after(step),
            SAMPLES_FILE: self._samples.truncate_after(step),
        }
        self._to_sinks("mark_restart", step)
        return dropped

    def close(self) -> None:
        """Closes every sink and log file; one failing sink does not keep the others open.

        Raises:
            The first error a sink raised while closing, after all were closed (a full disk:
            ``cannot_write``'s one line), else an event another thread could not write.
        """
        first_error: BaseException | None = None
        for closable in [*self.sinks, self._samples, self._events]:
            try:
                closable.close()
            except Exception as error:  # e.g. a remote tracker that cannot flush
                if says_no_room(error):
                    error = no_room(error, self._store_of(closable))
                first_error = first_error or error
        if first_error is not None:
            raise first_error
        self._raise_thread_error()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        try:
            self.close()
        except Exception:
            if exc is None:  # else the run's own error (a full disk) is the one it ends with
                raise
