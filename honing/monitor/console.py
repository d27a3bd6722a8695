"""One summary line per training step on the terminal, with a progress bar and an ETA.

    step 12/200 [#...................] 6% | score 0.41 | pg_loss -0.012 | 0.42 s/step | ETA 1m19s

On a terminal (TTY) the line is redrawn in place, cut to the terminal's width (a wrapped
line could not be redrawn); on anything else (a log file, a pipe, a notebook capture) every
``total_steps // 50``-th step prints a plain line, with no carriage returns, so a whole run
is about 50 lines plus validations.
"""

from __future__ import annotations

import math
import shutil
import statistics
import sys
import time
from collections import deque
from typing import TextIO

STEP_TIME_KEY = "timing_s/step"

# Metric name -> short label, in display order: the few numbers worth a glance per step.
DEFAULT_KEYS: dict[str, str] = {
    "critic/score/mean": "score",
    "val/accuracy": "val/acc",
    "actor/pg_loss": "pg_loss",
    "actor/kl_loss": "kl_loss",
    "actor/entropy": "entropy",
    "response_length/mean": "len",
    "perf/throughput": "tok/s",
}

_CLEAR_LINE = "\r\x1b[K"


def format_eta(seconds: float) -> str:
    """Formats a remaining duration compactly: ``42s``, ``1m05s``, ``2h07m``, ``3d04h``.

    Seconds are rounded to the nearest whole second first; negative values count as 0.

    Args:
        seconds: Remaining time in seconds.

    Returns:
        The duration, or ``"?"`` when ``seconds`` is NaN or infinite.
    """
    if not math.isfinite(seconds):
        return "?"
    total = max(0, round(seconds))
    if total < 60:
        return f"{total}s"
    minutes, secs = divmod(total, 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"


def progress_bar(done: int, total: int, width: int = 20) -> str:
    """Draws ``[#####...............] 25%``: filled cells and percent, both rounded down.

    Args:
        done: Steps finished; clamped to ``[0, total]``.
        total: Steps in the run; must be positive.
        width: Number of cells between the brackets.

    Returns:
        The bar followed by a space and the whole percentage.

    Raises:
        ValueError: If ``total`` or ``width`` is not positive.
    """
    if total <= 0 or width <= 0:
        raise ValueError(f"progress_bar needs total > 0 and width > 0, got {total}, {width}")
    done = min(max(done, 0), total)
    filled = done * width // total
    percent = done * 100 // total
    return f"[{'#' * filled}{'.' * (width - filled)}] {percent}%"


def format_value(value: float) -> str:
    """Formats a metric for the console: 3 significant digits, no exponent above 100."""
    if not math.isfinite(value):
        return str(value)
    if abs(value) >= 100:
        return f"{value:.0f}"
    return f"{value:.3g}"


class ConsoleSink:
    """Prints one summary line per step: progress, a few key metrics, step time and ETA.

    The ETA is the median of the recent step times multiplied by the steps left; the median
    ignores one-off slow steps (validation, checkpointing). A step's time is the
    ``timing_s/step`` metric when present, else the wall-clock time since the previous write
    (since construction for the first write).

    Args:
        total_steps: Last step of the run (steps count from 1); must be positive.
        stream: Where to print; ``None`` means ``sys.stderr`` at construction time.
        keys: Metric names to show, in order; ``None`` means ``DEFAULT_KEYS``. Known names
            get their short label, others are shown by full name. Missing metrics are left
            out of the line.
        window: How many recent step times the ETA median uses.
        width: Columns of the in-place line on a TTY; ``None`` asks the terminal at each
            redraw (so resizing is followed).
    """

    def __init__(
        self,
        total_steps: int,
        stream: TextIO | None = None,
        keys: list[str] | None = None,
        window: int = 20,
        width: int | None = None,
    ) -> None:
        if total_steps <= 0:
            raise ValueError(f"total_steps must be positive, got {total_steps}")
        self.total_steps = total_steps
        self.stream = stream if stream is not None else sys.stderr
        self.keys = list(DEFAULT_KEYS) if keys is None else list(keys)
        self._step_times: deque[float] = deque(maxlen=window)
        self._last_write = time.monotonic()
        self._in_place = _is_tty(self.stream)
        self._line_pending = False
        self._last_line = ""
        self._log_every = max(1, total_steps // 50)
        self._width = width

    def write(self, step: int, metrics: dict[str, float]) -> None:
        """Prints the summary line of ``step``."""
        now = time.monotonic()
        step_time = metrics.get(STEP_TIME_KEY, now - self._last_write)
        self._last_write = now
        if math.isfinite(step_time):
            self._step_times.append(float(step_time))
        # Validation steps and the last step stay on screen; between them a terminal redraws
        # one line, and a log file gets every `_log_every`-th step (about 50 lines a run).
        milestone = step >= self.total_steps or any(k.startswith("val/") for k in metrics)
        if self._in_place or milestone or step % self._log_every == 0:
            self._show(self.format_line(step, metrics), keep=milestone)

    def format_line(self, step: int, metrics: dict[str, float]) -> str:
        """Builds the summary line for ``step`` from the metrics and recent step times."""
        parts = [f"step {step}/{self.total_steps} {progress_bar(step, self.total_steps)}"]
        for key in self.keys:
            if key in metrics and key != STEP_TIME_KEY:
                parts.append(f"{DEFAULT_KEYS.get(key, key)} {format_value(metrics[key])}")
        if self._step_times:
            median = statistics.median(self._step_times)
            remaining = max(self.total_steps - step, 0)
            parts.append(f"{format_value(median)} s/step")
            parts.append(f"ETA {format_eta(median * remaining)}")
        return " | ".join(parts)

    def note(self, text: str) -> None:
        """Prints a message on its own line; an in-place progress line is redrawn below it."""
        if self._line_pending:
            self.stream.write(_CLEAR_LINE + text + "\n" + self._last_line)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        """Ends the in-place line so later output starts on a fresh line."""
        if self._line_pending:
            self.stream.write("\n")
            self.stream.flush()
            self._line_pending = False

    def _show(self, line: str, keep: bool = False) -> None:
        if self._in_place:
            if not keep:
                width = self._width or shutil.get_terminal_size().columns
                line = line[: max(width - 1, 1)]  # the last column would wrap on some terminals
            self.stream.write(_CLEAR_LINE + line + ("\n" if keep else ""))
            self._line_pending = not keep
            self._last_line = "" if keep else line
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def _is_tty(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except (OSError, ValueError):
        return False
