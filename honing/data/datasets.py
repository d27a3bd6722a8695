"""Prompt datasets from JSON-lines and Parquet files, in verl's row schema.

One row is one problem::

    {"prompt": "What is 2+3?" | [{"role": "user", "content": "What is 2+3?"}, ...],
     "data_source": "gsm8k",                      # optional; default: the file's stem
     "reward_model": {"ground_truth": "5"},      # or a top-level "ground_truth" / "answer"
     "extra_info": {"index": 17, ...}}            # optional; passed to reward functions

Files ending in ``.jsonl`` or ``.json`` are read as one JSON object per line (a ``.json``
file holding a single JSON array of rows is accepted too); ``.parquet`` files are read with
pyarrow, imported only when needed. Empty lines are ignored.

A malformed row is an error that names ``file:line`` (``file: row N`` for Parquet and JSON
arrays, 0-based) and what is expected; with ``on_bad_row="skip"`` it is skipped and counted
instead. A file that yields no valid row is always an error, because training on nothing
is never what the user meant.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from honing.errors import DataError
from honing.types import Prompt

SUPPORTED_EXTENSIONS = (".jsonl", ".json", ".parquet")
ON_BAD_ROW_POLICIES = ("error", "skip")

_EXPECTED_ROW = (
    "expected a JSON object with 'prompt' (a string or a list of {role, content} messages) "
    "and 'reward_model': {'ground_truth': ...}"
)


class _BadRow(Exception):
    """A row that does not fit the schema; the message says what is wrong."""


def load_prompts(paths: list[str], *, on_bad_row: str = "error") -> tuple[list[Prompt], int]:
    """Load prompts from JSON-lines / Parquet files, in order.

    Args:
        paths: data files (``data.train_files`` or ``data.val_files``).
        on_bad_row: ``"error"`` raises on the first malformed row; ``"skip"`` skips and
            counts malformed rows.

    Returns:
        ``(prompts, skipped)``: the valid prompts of all files in file order, and how many
        rows were skipped. An empty ``paths`` gives ``([], 0)``.

    Raises:
        DataError: a file is missing, has an unsupported extension, cannot be read, yields
            no valid row, or (under ``"error"``) holds a malformed row or a duplicate id.
    """
    if on_bad_row not in ON_BAD_ROW_POLICIES:
        raise DataError(f"data.on_bad_row must be 'error' or 'skip', got {on_bad_row!r}")
    prompts: list[Prompt] = []
    seen_ids: dict[str, str] = {}
    skipped = 0
    basenames = [os.path.basename(path) for path in paths]
    for path in paths:
        file_prompts = 0
        basename, stem = os.path.basename(path), Path(path).stem
        if basenames.count(basename) > 1:  # gsm8k/train.jsonl + math/train.jsonl
            basename = str(path)
        for where, position, row in _read_rows(str(path)):
            try:
                if isinstance(row, _BadRow):
                    raise row
                prompt = _row_to_prompt(
                    row, default_source=stem, id_prefix=basename, position=position, where=where
                )
                if prompt.id in seen_ids:
                    raise _BadRow(
                        f"duplicate prompt id {prompt.id!r} (first seen at {seen_ids[prompt.id]})"
                        "; expected unique extra_info.index values and each file listed once"
                    )
            except _BadRow as bad:
                if on_bad_row == "error":
                    raise DataError(f"{where}: {bad}") from None
                skipped += 1
                continue
            seen_ids[prompt.id] = where
            prompts.append(prompt)
            file_prompts += 1
        if file_prompts == 0:
            raise DataError(f"{path}: no valid rows (all empty or skipped); {_EXPECTED_ROW}")
    return prompts, skipped


def _read_rows(path: str) -> Iterator[tuple[str, int, dict[str, Any] | _BadRow]]:
    """Yield ``(where, position, row)`` for every non-empty row of one file.

    ``where`` locates the row for error messages; ``position`` (1-based line, or 0-based row
    index) makes the prompt id when the row has no ``extra_info.index``. A row that is not
    valid JSON is yielded as a ``_BadRow`` so that the caller applies its policy to it like
    any other bad row.
    """
    if not os.path.exists(path):
        raise DataError(f"data file not found: {path} (check data.train_files / data.val_files)")
    extension = Path(path).suffix.lower()
    if extension not in SUPPORTED_EXTENSIONS:
        raise DataError(
            f"{path}: unsupported data file extension {extension or '(none)'!r}; "
            f"expected one of {', '.join(SUPPORTED_EXTENSIONS)}"
        )
    if extension == ".parquet":
        yield from _read_parquet(path)
    else:
        yield from _read_json_lines(path)


def _read_json_lines(path: str) -> Iterator[tuple[str, int, dict[str, Any] | _BadRow]]:
    """Rows of a JSON-lines file (or of a ``.json`` file holding one JSON array)."""
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: cannot read as UTF-8 text ({exc}); {_EXPECTED_ROW}") from None
    if path.lower().endswith(".json") and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}:{exc.lineno}: invalid JSON array ({exc.msg})") from None
        for index, row in enumerate(rows):
            yield f"{path}: row {index}", index, row
        return
    for line_number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{line_number}"
        try:
            yield where, line_number, json.loads(line)
        except json.JSONDecodeError as exc:
            yield where, line_number, _BadRow(f"invalid JSON ({exc.msg}); {_EXPECTED_ROW}")


def _read_parquet(path: str) -> Iterator[tuple[str, int, dict[str, Any] | _BadRow]]:
    """Rows of a Parquet file as Python dicts (struct columns become dicts)."""
    try:
        from pyarrow import parquet
    except ImportError:
        raise DataError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from None
    try:
        rows = parquet.read_table(path).to_pylist()
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several unrelated types
        message = " ".join(str(exc).split())
        raise DataError(f"{path}: cannot read Parquet file ({message})") from None
    for index, row in enumerate(rows):
        yield f"{path}: row {index}", index, row


def _row_to_prompt(
    row: Any, *, default_source: str, id_prefix: str, position: int, where: str = ""
) -> Prompt:
    """Validate one row against verl's schema and build its ``Prompt``.

    The id is ``f"{id_prefix}:index={extra_info['index']}"`` when the row has an index
    (stable when the file is re-ordered), else ``f"{id_prefix}:{position}"``: the two forms
    never meet, so a file that gives an index to some rows only still has unique ids.
    """
    if not isinstance(row, dict):
        raise _BadRow(f"row is a {type(row).__name__}; {_EXPECTED_ROW}")
    prompt = _validate_prompt(row.get("prompt"))
    data_source = row.get("data_source")
    if data_source is None:
        data_source = default_source
    elif not isinstance(data_source, str):
        raise _BadRow(f"'data_source' is a {type(data_source).__name__}; expected a string")
    extra_info = row.get("extra_info")
    if extra_info is None:
        extra_info = {}
    elif not isinstance(extra_info, dict):
        raise _BadRow(f"'extra_info' is a {type(extra_info).__name__}; expected an object")
    index = extra_info.get("index")
    return Prompt(
        id=f"{id_prefix}:{position}" if index is None else f"{id_prefix}:index={index}",
        prompt=prompt,
        ground_truth=_ground_truth(row),
        data_source=data_source,
        extra_info=dict(extra_info),
        origin=where,
    )


def _validate_prompt(prompt: Any) -> str | list[dict[str, str]]:
    """Return the prompt if it is a non-empty string or a list of chat messages."""
    if prompt is None:
        raise _BadRow(f"missing 'prompt'; {_EXPECTED_ROW}")
    if isinstance(prompt, str):
        if not prompt.strip():
            raise _BadRow("'prompt' is empty; expected the problem text")
        return prompt
    if not isinstance(prompt, list) or not prompt:
        raise _BadRow(
            f"'prompt' is a {type(prompt).__name__}; expected a string or a non-empty list "
            "of {role, content} messages"
        )
    for number, message in enumerate(prompt):
        if not isinstance(message, dict):
            raise _BadRow(
                f"prompt message {number} is a {type(message).__name__}; "
                "expected an object with string 'role' and 'content'"
            )
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise _BadRow(
                    f"prompt message {number} has no string {key!r}; "
                    "expected an object with string 'role' and 'content'"
                )
    return [dict(message) for message in prompt]


def _ground_truth(row: dict[str, Any]) -> Any:
    """``reward_model.ground_truth``, else a top-level ``ground_truth`` or ``answer``."""
    reward_model = row.get("reward_model")
    if isinstance(reward_model, dict) and reward_model.get("ground_truth") is not None:
        return reward_model["ground_truth"]
    for key in ("ground_truth", "answer"):
        if row.get(key) is not None:
            return row[key]
    raise _BadRow(
        "missing ground truth; expected 'reward_model': {'ground_truth': ...} "
        "(or a top-level 'ground_truth' / 'answer')"
    )
