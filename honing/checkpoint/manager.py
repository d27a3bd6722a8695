"""Atomic, retained checkpoints on the local filesystem: ``ROOT/step_<N>/``.

A checkpoint is written into ``ROOT/.tmp-step_<N>-<random>/``, every file is fsync-ed, a
``COMPLETE`` marker is written last, and only then is the directory renamed to
``step_<N>``. A directory named ``step_<N>`` that holds ``COMPLETE`` is therefore whole; a
crash at any moment leaves at worst a ``.tmp-*`` directory, which is never loaded.

What goes inside a checkpoint is the caller's business (a ``write(dir)`` callback), so this
module imports no torch. One process writes to a root at a time; concurrent writers are not
coordinated.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from honing.errors import UserError

MARKER = "COMPLETE"
STEP_PREFIX = "step_"
TMP_PREFIX = ".tmp-"
_STEP_DIR = re.compile(r"step_(\d+)")


def _fsync_dir(path: Path) -> None:
    """Makes a directory's entries (creations, renames) durable; a no-op on Windows."""
    if os.name == "nt":
        return
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _fsync_tree(root: Path) -> None:
    """Fsyncs every file under ``root``, then every directory, deepest first."""
    directories: list[Path] = []
    for current, _, files in os.walk(root):
        directories.append(Path(current))
        for name in files:
            file_path = Path(current, name)
            if file_path.is_symlink():
                continue
            with file_path.open("rb") as handle:
                os.fsync(handle.fileno())
    for directory in reversed(directories):
        _fsync_dir(directory)


def _remove(path: Path) -> None:
    """Deletes a directory tree after renaming it to a ``.tmp-`` name.

    The rename is atomic, so a crash halfway through deleting never leaves a partial
    directory that still looks like a complete checkpoint.
    """
    doomed = path.with_name(f"{TMP_PREFIX}delete-{path.name}-{secrets.token_hex(4)}")
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def read_marker(checkpoint: str | Path) -> dict[str, Any]:
    """Returns the ``COMPLETE`` marker of a checkpoint: ``{"step": N, "time": unix_time}``."""
    return json.loads((Path(checkpoint) / MARKER).read_text(encoding="utf-8"))


class CheckpointManager:
    """Saves checkpoints atomically under ``root`` and keeps the newest ``keep`` of them.

    Args:
        root: Directory of the checkpoints, e.g. ``RUN_DIR/checkpoints``; created on the
            first save.
        keep: How many complete checkpoints to retain (>= 1); older ones are deleted after
            each save.
    """

    def __init__(self, root: str | Path, keep: int) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.root = Path(root)
        self.keep = keep

    def path_for(self, step: int) -> Path:
        """The directory a complete checkpoint of ``step`` has: ``root/step_<step>``."""
        return self.root / f"{STEP_PREFIX}{step}"

    def save(self, step: int, write: Callable[[Path], None]) -> Path:
        """Writes a checkpoint of ``step`` atomically and applies retention.

        Args:
            step: Training step (>= 0) the checkpoint holds.
            write: Fills the given (empty, temporary) directory with the checkpoint files.

        Returns:
            The published directory, ``root/step_<step>``. An existing checkpoint of the
            same step is replaced.

        Raises:
            Exception: Whatever ``write`` raised; the temporary directory is removed first,
                and any earlier checkpoint of the step is left as it was.
        """
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{STEP_PREFIX}{step}-", dir=self.root))
        try:
            write(tmp)
            _fsync_tree(tmp)
            marker = tmp / MARKER
            with marker.open("w", encoding="utf-8") as handle:
                json.dump({"step": step, "time": time.time()}, handle)
                handle.flush()
                os.fsync(handle.fileno())
            _fsync_dir(tmp)
            final = self._publish(tmp, step)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._prune(protect=step)
        return final

    def _publish(self, tmp: Path, step: int) -> Path:
        """Renames a finished temporary directory to ``step_<step>``, replacing an old one."""
        final = self.path_for(step)
        aside = None
        if final.exists():
            aside = self.root / f"{TMP_PREFIX}old-{final.name}-{secrets.token_hex(4)}"
            os.replace(final, aside)
        try:
            os.replace(tmp, final)
        except BaseException:
            if aside is not None:
                os.replace(aside, final)
            raise
        _fsync_dir(self.root)
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
        return final

    def _prune(self, protect: int) -> None:
        """Deletes complete checkpoints older than the newest ``keep``, except ``protect``.

        The checkpoint just saved is protected even when newer ones exist (a run resumed
        from an earlier checkpoint), so a save is never undone by its own retention.
        """
        steps = self.complete_steps()
        for step in steps[: max(len(steps) - self.keep, 0)]:
            if step != protect:
                _remove(self.path_for(step))

    def complete_steps(self) -> list[int]:
        """Steps of the complete checkpoints (``step_<N>`` holding ``COMPLETE``), ascending."""
        if not self.root.is_dir():
            return []
        steps = []
        for entry in self.root.iterdir():
            match = _STEP_DIR.fullmatch(entry.name)
            if match and entry.is_dir() and (entry / MARKER).is_file():
                steps.append(int(match.group(1)))
        return sorted(steps)

    def latest(self) -> Path | None:
        """The complete checkpoint with the highest step, or ``None`` if there is none."""
        steps = self.complete_steps()
        return self.path_for(steps[-1]) if steps else None

    def incomplete(self) -> list[Path]:
        """Leftovers never loaded: ``.tmp-*`` entries and ``step_<N>`` dirs without a marker.

        Reported so the caller can log them; ``cleanup_incomplete`` removes the ``.tmp-*``
        ones.
        """
        if not self.root.is_dir():
            return []
        leftovers = []
        for entry in self.root.iterdir():
            unmarked_step = _STEP_DIR.fullmatch(entry.name) and not (entry / MARKER).is_file()
            if entry.name.startswith(TMP_PREFIX) or unmarked_step:
                leftovers.append(entry)
        return sorted(leftovers)

    def cleanup_incomplete(self) -> list[Path]:
        """Removes the ``.tmp-*`` leftovers of interrupted saves and returns their paths.

        ``step_<N>`` directories without a marker were not made by this manager and are left
        alone. Call it only when no save is in progress.
        """
        removed = [path for path in self.incomplete() if path.name.startswith(TMP_PREFIX)]
        for path in removed:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        return removed

    def resolve(self, spec: str) -> Path | None:
        """Chooses the checkpoint to resume from, for ``--resume auto|never|PATH``.

        Args:
            spec: ``"never"`` (start fresh), ``"auto"`` (the latest complete checkpoint, if
                any), or the path of a checkpoint directory.

        Returns:
            The checkpoint directory, or ``None`` to start from scratch.

        Raises:
            UserError: If ``spec`` is a path that is not a complete checkpoint.
        """
        if spec == "never":
            return None
        if spec == "auto":
            return self.latest()
        path = Path(spec)
        if not (path / MARKER).is_file():
            reason = "does not exist" if not path.exists() else f"has no {MARKER} marker"
            raise UserError(
                f"--resume {spec}: not a complete checkpoint ({reason}); "
                "expected a checkpoint directory such as checkpoints/step_<N>, or auto|never"
            )
        return path
