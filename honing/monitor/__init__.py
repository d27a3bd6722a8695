"""Run monitoring: per-step metrics to JSONL, TensorBoard and the console; samples; events.

``RunLogger`` owns a run directory's log files; the sinks are usable on their own.
Importing this package does not import tensorboard (only ``TensorBoardSink`` does).
"""

from honing.monitor.console import ConsoleSink, format_eta, progress_bar
from honing.monitor.logger import RunLogger, aggregate
from honing.monitor.sinks import JsonlSink, MetricSink, truncate_jsonl
from honing.monitor.tensorboard_sink import TensorBoardSink

__all__ = [
    "ConsoleSink",
    "JsonlSink",
    "MetricSink",
    "RunLogger",
    "TensorBoardSink",
    "aggregate",
    "format_eta",
    "progress_bar",
    "truncate_jsonl",
]
