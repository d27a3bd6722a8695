"""Metric sinks: where one step's metrics go (the JSONL files; TensorBoard's event files are
``tensorboard_sink``'s).

A sink receives ``(step, {name: value})`` once per training step. Sinks are composed by
``RunLogger``; each one owns one destination and flushes on every write, so a crash of the
training process loses nothing already logged. Besides ``write`` and ``close`` a sink may
implement any of the optional methods ``RunLogger`` looks for: ``write_histograms`` (value
distributions, see ``HistogramSink``), ``note`` (event lines), ``mark_restart`` (a resumed
run redoes later steps) and ``log_report`` (the run's report file, at the end of the run); a
sink without one is simply skipped for that call. Machine crashes (power loss) can still
lose the last writes: files are flushed to the OS, not fsync-ed, except when rewritten by
``truncate_jsonl``. A write that fails (a full disk) is undone, so a JSONL file never holds
half a line nor an event file half a record, and ends the run with one line (``UserError``,
``cannot_write``), worded as a checkpoint that finds no room.
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from honing.checkpoint.disk import free_bytes, nearest_existing, says_no_space
from honing.errors import UserError

RESUME = "resume with --resume auto"


class MetricSink(Protocol):
    """Destination for per-step metrics."""

    def write(self, step: int, metrics: dict[str, float]) -> None:
        """Records the metrics of one training step."""
        ...

    def close(self) -> None:
        """Flushes and releases the destination; no write may follow."""
        ...


@runtime_checkable
class HistogramSink(Protocol):
    """A sink that also records value distributions (rewards, response lengths)."""

    def write_histograms(self, step: int, histograms: Mapping[str, Sequence[float]]) -> None:
        """Records, for each name, the distribution of the values seen at ``step``."""
        ...


def json_safe(value: Any) -> Any:
    """Returns ``value`` in a form ``json.dumps(..., allow_nan=False)`` accepts.

    Non-finite floats become ``None`` (JSON has no NaN); tuples become lists; scalars of
    array libraries (anything with ``.item()``) become Python numbers; other unknown objects
    become their ``str``. Keys of mappings become strings.

    Args:
        value: A metric value, sample or event field, possibly nested.

    Returns:
        A structure of dicts, lists, str, int, float, bool and None.
    """
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(key): json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    if hasattr(value, "item"):
        try:
            return json_safe(value.item())
        except (TypeError, ValueError):
            pass
    return str(value)


def to_json_line(record: Mapping[str, Any]) -> str:
    """Serialises one record as a single JSONL line, newline included."""
    return json.dumps(json_safe(record), allow_nan=False, ensure_ascii=False) + "\n"


def truncate_jsonl(path: str | Path, step: int) -> int:
    """Drops the lines of a JSONL file whose ``"step"`` is greater than ``step``.

    Used when a run resumes from a checkpoint older than its last logged step, so the file
    never holds a step twice. Lines without a ``"step"`` field are kept; lines that are not
    valid JSON (the torn last line of a crash) are dropped. The file is rewritten through a
    temporary file in the same directory, fsync-ed and ``os.replace``-d, so a crash leaves
    either the old or the new file, never a mix.

    Args:
        path: The JSONL file; a missing file is left missing.
        step: The last step to keep.

    Returns:
        The number of lines dropped.
    """
    path = Path(path)
    if not path.exists():
        return 0
    kept: list[str] = []
    dropped = 0
    with path.open(encoding="utf-8") as source:
        for line in source:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                dropped += 1
                continue
            line_step = record.get("step") if isinstance(record, dict) else None
            if isinstance(line_step, (int, float)) and line_step > step:
                dropped += 1
                continue
            kept.append(line if line.endswith("\n") else line + "\n")
    descriptor, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as target:
            target.writelines(kept)
            target.flush()
            os.fsync(target.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    return dropped


def _torn_tail(path: Path) -> tuple[int, bytes] | None:
    """``(offset, bytes)`` of the text after a file's last newline, when it does not end with
    one; ``None`` for a missing or empty file or one that ends with a newline."""
    if not path.exists() or path.stat().st_size == 0:
        return None
    with path.open("rb") as handle:
        end = handle.seek(0, os.SEEK_END)
        handle.seek(end - 1)
        if handle.read(1) == b"\n":
            return None
        position, tail = end, b""
        while position > 0:  # back to the last newline, a block at a time
            size = min(1 << 16, position)
            position -= size
            handle.seek(position)
            tail = handle.read(size) + tail
            newline = tail.rfind(b"\n")
            if newline >= 0:
                return position + newline + 1, tail[newline + 1 :]
        return 0, tail


def says_no_room(err: BaseException) -> bool:
    """Whether the exception's chain says the disk (or quota) is full: an ``ENOSPC`` or
    ``EDQUOT`` error (``says_no_space``), or SQLite's ``SQLITE_FULL`` ("database or disk is
    full"), which a tracker keeping its store in SQLite (MLflow's ``sqlite:``) raises."""
    if says_no_space(err):
        return True
    seen: BaseException | None = err
    while seen is not None:
        if getattr(seen, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def named_file(err: BaseException) -> Path | None:
    """The file the first ``OSError`` of the exception's chain names, if one does."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, OSError) and isinstance(seen.filename, (str, bytes, os.PathLike)):
            return Path(os.fsdecode(seen.filename))
        seen = seen.__cause__ or seen.__context__
    return None


def cannot_write(path: str | Path, err: BaseException, then: str = RESUME) -> UserError:
    """The one line a log file that cannot be written ends the run with (exit status 2).

    A full disk (``ENOSPC``, a full quota) reads as a checkpoint that finds no room does: the
    free space there, then "free some space, then resume with --resume auto".

    Args:
        path: The file that could not be written.
        err: What the write raised.
        then: What to do once the disk has room again.
    """
    path = Path(path)
    if says_no_room(err):
        free = (free_bytes(nearest_existing(path.parent)) or 0) / (1 << 20)
        return UserError(
            f"cannot write {path}: the disk is full ({free:.1f} MiB free there); "
            f"free some space, then {then}"
        )
    reason = err.strerror if isinstance(err, OSError) and err.strerror else err
    return UserError(f"cannot write {path} ({reason}); fix that, then {then}")


def no_room(err: BaseException, where: str | Path) -> UserError:
    """``cannot_write``'s line for an error that ``says_no_room``: of the file the error
    names, else of ``where`` (a tracker's store, the run directory). A ``UserError`` is
    already that line."""
    if isinstance(err, UserError):
        return err
    return cannot_write(named_file(err) or where, err)


def append_whole(handle: Any, path: Path, data: bytes) -> None:
    """Appends ``data`` to an unbuffered binary file, all or nothing.

    Raises:
        UserError: The write failed (``cannot_write``); the file is cut back to its length
            before the call.
    """
    start = os.lseek(handle.fileno(), 0, os.SEEK_END)
    try:
        view = memoryview(data)
        while view:
            view = view[handle.write(view) :]
    except OSError as err:
        os.ftruncate(handle.fileno(), start)  # no half line, no half record
        raise cannot_write(path, err) from None


class JsonlSink:
    """Appends one JSON object per line to a file (``metrics.jsonl`` and friends).

    Opening an existing file appends to it. A last line without its final newline was torn
    by a crash: it is cut off when it is not valid JSON, else given its newline, so the next
    record starts on a line of its own and the file holds only whole records. Each append
    goes straight to the OS (no buffer) and a failed one is cut back off, so a full disk
    leaves whole lines too.

    Args:
        path: The file; its parent directory is created if missing.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self._open()

    def _open(self) -> Any:
        tail = _torn_tail(self.path)
        if tail is not None:
            start, text = tail
            try:
                json.loads(text)
            except ValueError:
                os.truncate(self.path, start)  # half a record: drop it
                tail = None
        handle = self.path.open("ab", buffering=0)
        if tail is not None:
            append_whole(handle, self.path, b"\n")
        return handle

    def write(self, step: int, metrics: dict[str, float]) -> None:
        """Appends ``{"step": step, **metrics, "time": unix_time}``; flushes.

        ``step`` and ``time`` take precedence over metrics of the same name.
        """
        record: dict[str, Any] = {"step": step}
        record.update(metrics)
        record["step"] = step
        record["time"] = time.time()
        self.append([record])

    def append(self, records: Iterable[Mapping[str, Any]]) -> None:
        """Appends records as they are (non-finite floats become null), all or none.

        Raises:
            UserError: The file cannot be written (a full disk); nothing of the records
                stays in it.
        """
        if self._file is None:
            raise ValueError(f"{self.path}: sink is closed")
        data = "".join(to_json_line(record) for record in records).encode("utf-8")
        append_whole(self._file, self.path, data)

    def truncate_after(self, step: int) -> int:
        """Drops lines with a step greater than ``step`` (see ``truncate_jsonl``).

        Returns:
            The number of lines dropped.

        Raises:
            UserError: The file cannot be rewritten (a full disk): ``cannot_write``.
        """
        was_open = self._file is not None
        self.close()
        try:
            dropped = truncate_jsonl(self.path, step)
        except OSError as err:  # the file is left as it was
            raise cannot_write(self.path, err) from None
        if was_open:
            self._file = self._open()
        return dropped

    def close(self) -> None:
        """Closes the file; further writes raise ``ValueError``."""
        if self._file is not None:
            self._file.close()
            self._file = None
