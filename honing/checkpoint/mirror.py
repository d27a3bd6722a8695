"""The archive tier: copies of checkpoints at an fsspec URL (a local path, ``file://``, ``s3://``).

The local ``RUN_DIR/checkpoints`` is the hot tier (every save, few kept); the mirror gets every
M-th checkpoint and keeps them all, so losing the run's disk loses at most M saves. A copy
follows the local discipline as far as object stores allow: files go under
``URL/.tmp-step_<N>-<random>/``, the directory is moved to ``URL/step_<N>/`` (a rename on a
local filesystem, copy + delete on S3), and the ``COMPLETE`` marker is written last, so a copy
interrupted at any moment has no marker and is never chosen. ``manifest.json`` travels with
the files, so a copy that came back damaged is caught when it is verified.

Limits: one writer per mirror URL (point each run at its own); the copy runs in the training
process, synchronously, and local mirrors are not fsync-ed (verification catches what a power
loss tears); remote credentials come from fsspec's usual sources (environment, config files).
"""

from __future__ import annotations

import posixpath
import re
import secrets
from pathlib import Path

MARKER = "COMPLETE"
TMP_PREFIX = ".tmp-"
_STEP_DIR = re.compile(r"step_(\d+)")


class Mirror:
    """A second home for checkpoints, at ``url``.

    Args:
        url: An fsspec URL or a local path; the directory that will hold ``step_<N>/``.
    """

    def __init__(self, url: str) -> None:
        import fsspec  # only runs that mirror pay for the import

        self.url = url
        self.fs, self.root = fsspec.core.url_to_fs(url)

    def path_for(self, step: int) -> str:
        """Where the copy of ``step`` lives in the mirror's filesystem."""
        return posixpath.join(self.root, f"step_{step}")

    def push(self, local: Path, step: int) -> str:
        """Copies the complete local checkpoint ``local`` to ``step_<step>``, marker last.

        An existing copy of the step is replaced. Leftovers of interrupted pushes are removed
        first.

        Returns:
            The copy's path in the mirror's filesystem.

        Raises:
            OSError: Or any fsspec error; the copy then has no marker.
        """
        self.fs.makedirs(self.root, exist_ok=True)
        self._remove_leftovers()
        tmp = posixpath.join(self.root, f"{TMP_PREFIX}step_{step}-{secrets.token_hex(4)}")
        for path in sorted(p for p in local.rglob("*") if p.is_file() and p.name != MARKER):
            target = posixpath.join(tmp, path.relative_to(local).as_posix())
            self.fs.makedirs(posixpath.dirname(target), exist_ok=True)
            self.fs.put_file(str(path), target)
        final = self.path_for(step)
        if self.fs.exists(final):
            self.fs.rm(final, recursive=True)
        self.fs.mv(tmp, final, recursive=True)
        self.fs.put_file(str(local / MARKER), posixpath.join(final, MARKER))
        return final

    def _remove_leftovers(self) -> None:
        for entry in self.fs.ls(self.root, detail=False):
            if posixpath.basename(entry.rstrip("/")).startswith(TMP_PREFIX):
                self.fs.rm(entry, recursive=True)

    def complete_steps(self) -> list[int]:
        """Steps of the copies that hold a marker, ascending ([] when the mirror is empty)."""
        if not self.fs.exists(self.root):
            return []
        steps = []
        for entry in self.fs.ls(self.root, detail=False):
            match = _STEP_DIR.fullmatch(posixpath.basename(entry.rstrip("/")))
            if match and self.fs.exists(posixpath.join(entry, MARKER)):
                steps.append(int(match.group(1)))
        return sorted(steps)

    def fetch(self, step: int, into: Path) -> None:
        """Copies the files of the copy of ``step`` (all but the marker) into ``into``.

        Used as a ``CheckpointManager.save`` writer, so the download lands atomically in the
        local tier and is verified there like any other checkpoint.
        """
        source = self.path_for(step)
        for remote in sorted(self.fs.find(source)):
            relative = posixpath.relpath(remote, source)
            if relative == MARKER:
                continue
            target = into / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            self.fs.get_file(remote, str(target))
