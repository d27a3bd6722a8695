"""TensorBoard's event files: each step's scalars and histograms, as TensorBoard reads them.

The events are framed and appended here, on the calling thread, rather than by TensorBoard's
own writer, which queues them for a thread of its own: its failure on a full disk is that
thread's traceback on stderr, and a half-written record. Here an event that does not fit is
cut back off and ends the run with ``cannot_write``'s one line.

TensorBoard is imported inside the functions only, so ``import honing.monitor`` stays light.
"""

from __future__ import annotations

import itertools
import os
import socket
import struct
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from honing.monitor.sinks import append_whole, cannot_write

_EVENT_FILE_IDS = itertools.count()  # tells apart the event files of one process and second


def _tf_record(data: bytes) -> bytes:
    """``data`` framed as a TFRecord, the event file's format: length (uint64), the length's
    masked CRC-32C (uint32), the data, the data's masked CRC-32C; little-endian."""
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

    header = struct.pack("<Q", len(data))
    return (
        header
        + struct.pack("<I", masked_crc32c(header))
        + data
        + struct.pack("<I", masked_crc32c(data))
    )


class TensorBoardSink:
    """Writes each metric as a TensorBoard scalar, in TensorBoard's event file format.

    One event per step carries one scalar value per metric name. NaN and infinities are
    written as they are (TensorBoard plots them as such). Values that are not numbers are
    skipped. Histograms (``write_histograms``) are written in TensorBoard's classic
    ``HistogramProto`` form, which its Histograms and Distributions tabs show.

    Args:
        log_dir: Directory for the ``events.out.tfevents.*`` files; created if missing. A
            resumed run adds a new event file next to the old ones.

    Raises:
        UserError: The event file cannot be created or written (a full disk).
    """

    def __init__(self, log_dir: str | Path) -> None:
        from tensorboard.compat.proto.event_pb2 import Event, SourceMetadata

        self.log_dir = Path(log_dir)
        name = (
            f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}."
            f"{os.getpid()}.{next(_EVENT_FILE_IDS)}"
        )
        self.path = self.log_dir / name
        try:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            self._file: Any = self.path.open("ab", buffering=0)
        except OSError as err:
            raise cannot_write(self.path, err) from None
        # The first event names the format's version: TensorBoard's loader reads restart
        # markers (``mark_restart``) only in files of version 2.
        self._add(
            Event(
                wall_time=time.time(),
                file_version="brain.Event:2",
                source_metadata=SourceMetadata(writer="honing"),
            )
        )

    def _add(self, event: Any) -> None:
        if self._file is None:
            raise ValueError(f"{self.path}: sink is closed")
        append_whole(self._file, self.path, _tf_record(event.SerializeToString()))

    def write(self, step: int, metrics: dict[str, float]) -> None:
        """Appends one event holding all numeric metrics at ``step``."""
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = []
        for name, value in metrics.items():
            try:
                number = float(value)
            except (TypeError, ValueError):
                continue
            values.append(Summary.Value(tag=name, simple_value=number))
        self._add(Event(wall_time=time.time(), step=step, summary=Summary(value=values)))

    def write_histograms(self, step: int, histograms: Mapping[str, Sequence[float]]) -> None:
        """Appends one event holding a histogram per name at ``step``.

        Non-finite values are left out of the buckets (a histogram cannot place them); a name
        whose values are all non-finite, or empty, is skipped.
        """
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = []
        for name, data in histograms.items():
            proto = histogram_proto(data)
            if proto is not None:
                values.append(Summary.Value(tag=name, histo=proto))
        if values:
            self._add(Event(wall_time=time.time(), step=step, summary=Summary(value=values)))

    def mark_restart(self, step: int) -> None:
        """Records a restart after ``step``: TensorBoard hides older data at later steps.

        Writes a ``SessionLog.START`` event at ``step + 1``; TensorBoard's loader then purges
        previously written events with a step greater than ``step``, matching
        ``truncate_jsonl`` on the JSONL files.
        """
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog

        self._add(
            Event(
                wall_time=time.time(),
                step=step + 1,
                session_log=SessionLog(status=SessionLog.START),
            )
        )

    def close(self) -> None:
        """Closes the event file; further writes raise ``ValueError``."""
        if self._file is not None:
            self._file.close()
            self._file = None


def histogram_proto(data: Sequence[float], max_buckets: int = 30) -> Any:
    """Buckets ``data`` into a TensorBoard ``HistogramProto`` (``None`` if nothing finite).

    Integer data with few distinct values (response lengths) gets one bucket per integer;
    other data gets up to ``max_buckets`` equal-width buckets. ``bucket_limit[i]`` is the
    right edge of bucket ``i``, TensorBoard's convention.
    """
    import numpy as np
    from tensorboard.compat.proto.summary_pb2 import HistogramProto

    array = np.asarray(data, dtype=np.float64).ravel()
    array = array[np.isfinite(array)]
    if array.size == 0:
        return None
    low, high = float(array.min()), float(array.max())
    if low == high:
        edges = np.array([low - 0.5, high + 0.5])
    elif np.all(array == np.round(array)) and high - low < max_buckets:
        edges = np.arange(low - 0.5, high + 1.0, 1.0)  # one bucket per integer
    else:
        edges = np.linspace(low, high, max_buckets + 1)
    counts, edges = np.histogram(array, bins=edges)
    return HistogramProto(
        min=low,
        max=high,
        num=float(array.size),
        sum=float(array.sum()),
        sum_squares=float(np.dot(array, array)),
        bucket_limit=edges[1:].tolist(),
        bucket=counts.astype(np.float64).tolist(),
    )
