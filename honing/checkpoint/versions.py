"""The saved versions of a run, for ``honing checkpoints RUN_DIR``: one row per checkpoint.

Each row joins what the checkpoint says about itself (step, time written, size, whether its
files still match the manifest) with what ``metrics.jsonl`` says about the policy it holds
(the step's mean reward, the latest validation accuracy at or before it), so a person can
pick the version to go back to with ``--resume PATH``.

Limits: only the local tier (``RUN_DIR/checkpoints``) is listed; every checkpoint is read
once to verify it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from honing.checkpoint.manager import read_marker
from honing.checkpoint.manifest import MARKER, STEP_DIR, manifest_size, verify

SCORE_KEY = "critic/score/mean"
VAL_KEY = "val/accuracy"


def _metrics_by_step(run_dir: Path) -> dict[int, dict[str, Any]]:
    """``metrics.jsonl`` as step -> record (the last line of a step wins; torn lines skipped)."""
    path = run_dir / "metrics.jsonl"
    by_step: dict[int, dict[str, Any]] = {}
    if not path.is_file():
        return by_step
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            by_step[record["step"]] = record
    return by_step


def _row(path: Path, step: int, metrics: dict[int, dict[str, Any]]) -> dict[str, Any]:
    complete = (path / MARKER).is_file()
    problem = verify(path) if complete else f"no {MARKER} marker (an interrupted save)"
    validated = [s for s in metrics if s <= step and metrics[s].get(VAL_KEY) is not None]
    val_step = max(validated, default=None)
    return {
        "step": step,
        "path": str(path),
        "time": read_marker(path).get("time") if complete else None,
        "size": manifest_size(path) if complete else None,
        "ok": problem is None,
        "problem": problem,
        SCORE_KEY: metrics.get(step, {}).get(SCORE_KEY),
        VAL_KEY: metrics[val_step][VAL_KEY] if val_step is not None else None,
        "val_step": val_step,
        "last_good": False,
    }


def list_checkpoints(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every ``step_<N>`` directory of a run's local tier, ascending by step.

    Returns:
        Rows with ``step``, ``path``, ``time`` (unix, from the marker), ``size`` (bytes in
        the manifest), ``ok`` (marker present and files match the manifest), ``problem``
        (why not, else ``None``), ``critic/score/mean`` at that step, ``val/accuracy`` (the
        latest at or before the step) with its ``val_step``, and ``last_good`` (true on the
        newest ok row: the one ``--resume auto`` takes).
    """
    run_dir = Path(run_dir)
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    metrics = _metrics_by_step(run_dir)
    rows = []
    for entry in root.iterdir():
        match = STEP_DIR.fullmatch(entry.name)
        if match and entry.is_dir():
            rows.append(_row(entry, int(match.group(1)), metrics))
    rows.sort(key=lambda row: row["step"])
    good = [row for row in rows if row["ok"]]
    if good:
        good[-1]["last_good"] = True
    return rows


def _size(size: int | None) -> str:
    if size is None:
        return "-"
    return f"{size / (1 << 20):.1f} MiB" if size >= 1 << 20 else f"{size / 1024:.1f} KiB"


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def format_checkpoints(rows: list[dict[str, Any]]) -> str:
    """A plain-text table of ``list_checkpoints`` rows; ``*`` marks the last good one.

    Damaged rows say why at the end of the line. An empty list gives a one-line note.
    """
    if not rows:
        return "no checkpoints"
    header = ["", "step", "saved", "size", "files", SCORE_KEY, VAL_KEY, "path"]
    table = [header]
    for row in rows:
        saved = (
            "-"
            if row["time"] is None
            else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(row["time"]))
        )
        val = _number(row[VAL_KEY])
        if row["val_step"] is not None and row["val_step"] != row["step"]:
            val += f" (step {row['val_step']})"
        files = "ok" if row["ok"] else "DAMAGED"
        table.append(
            [
                "*" if row["last_good"] else "",
                str(row["step"]),
                saved,
                _size(row["size"]),
                files,
                _number(row[SCORE_KEY]),
                val,
                row["path"],
            ]
        )
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)) for line in table
    ]
    for index, row in enumerate(rows, start=1):
        if not row["ok"]:
            lines[index] += f"  ({row['problem']})"
    lines = [line.rstrip() for line in lines]
    if any(row["last_good"] for row in rows):
        lines.append("* the last good checkpoint: what --resume auto takes")
    else:
        lines.append("no good checkpoint: --resume auto would start from scratch")
    return "\n".join(lines)
