"""Atomic, verified, retained checkpoints on the local filesystem: ``ROOT/step_<N>/``.

A checkpoint is written into ``ROOT/.tmp-step_<N>-<random>/``, a ``manifest.json`` of every
file's size and sha256 is added, every file is fsync-ed, a ``COMPLETE`` marker is written
last, and only then is the directory renamed to ``step_<N>``. A crash at any moment leaves at
worst a ``.tmp-*`` directory, which is never loaded; a checkpoint damaged afterwards fails its
manifest and is skipped by ``--resume auto`` (with a ``checkpoint_corrupt`` event), which falls
back to the next newest good one, then to the mirror (``honing.checkpoint.mirror``).

A save that fails for lack of room (``OSError``, or torch's ``RuntimeError`` about a failed
write) removes its partial directory, leaves the earlier checkpoints as they were, reports a
``checkpoint_failed`` event and raises ``CheckpointSaveError``; what the run does then is the
caller's policy (``honing.pipeline.state``).

What goes inside a checkpoint is the caller's business (a ``write(dir)`` callback), so this
module imports no torch. One process writes to a root at a time; concurrent writers are not
coordinated. Events go to ``on_event(kind, **fields)`` (``RunLogger.log_event`` fits).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from honing.checkpoint.archive import Archive
from honing.checkpoint.disk import (
    FULL_BELOW,
    free_bytes,
    is_write_failure,
    says_no_space,
    tree_bytes,
)
from honing.checkpoint.manifest import (
    MARKER,
    STEP_DIR,
    STEP_PREFIX,
    TMP_PREFIX,
    verify,
    write_manifest,
)
from honing.checkpoint.mirror import Mirror
from honing.errors import UserError, error_line

EventSink = Callable[..., None]
# What the uploads under way get when a run is interrupted (SIGTERM, Ctrl-C) at their wait,
# or mid-step before it.
INTERRUPT_GRACE_S = 30.0


class CheckpointSaveError(OSError):
    """A checkpoint could not be written (usually a full disk); earlier ones are intact."""


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
        mirror_url: Where every ``mirror_every``-th checkpoint is also copied (an fsspec URL
            or local path); ``""`` for none. Copies are uploaded in the background.
        mirror_every: Mirror the checkpoints whose step is a multiple of this (>= 1).
        mirror_keep: Copies the mirror keeps, newest first (0 = all).
        mirror_attempts, mirror_backoff_s: Tries per upload, and the wait after the n-th
            failed one (n × this).
        on_event: Called as ``on_event(kind, **fields)`` for ``checkpoint_corrupt``,
            ``checkpoint_verified``, ``checkpoint_failed``, ``checkpoint_refused``,
            ``checkpoint_mirrored``, ``mirror_failed``, ``mirror_unfinished`` and
            ``checkpoint_from_mirror`` (the mirror's from the upload thread); ``None`` drops
            them.
    """

    def __init__(
        self,
        root: str | Path,
        keep: int,
        *,
        mirror_url: str = "",
        mirror_every: int = 1,
        mirror_keep: int = 0,
        mirror_attempts: int = 3,
        mirror_backoff_s: float = 1.0,
        on_event: EventSink | None = None,
    ) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        if mirror_every < 1:
            raise ValueError(f"mirror_every must be >= 1, got {mirror_every}")
        self.root = Path(root)
        self.keep = keep
        self.on_event = on_event
        self.mirror = Mirror(mirror_url) if mirror_url else None
        self.mirror_every = mirror_every
        self.archive = (
            Archive(self.mirror, mirror_keep, mirror_attempts, mirror_backoff_s, self._event)
            if self.mirror is not None
            else None
        )
        self._free_at_failure: int | None = None  # free bytes when the last write failed
        self._listed: list[int] | None = None  # the mirror's steps, as check_mirror found them

    def _event(self, kind: str, **fields: Any) -> None:
        if self.on_event is not None:
            self.on_event(kind, **fields)

    def path_for(self, step: int) -> Path:
        """The directory a complete checkpoint of ``step`` has: ``root/step_<step>``."""
        return self.root / f"{STEP_PREFIX}{step}"

    def save(
        self,
        step: int,
        write: Callable[[Path], None],
        expected_bytes: Callable[[], int] | None = None,
    ) -> Path:
        """Writes a checkpoint of ``step`` atomically, applies retention, mirrors on schedule.

        Args:
            step: Training step (>= 0) the checkpoint holds.
            write: Fills the given (empty, temporary) directory with the checkpoint files.
            expected_bytes: About what the checkpoint takes, asked only for the message of a
                save that finds no room before any checkpoint was written (otherwise the
                newest one's size is used).

        Returns:
            The published directory, ``root/step_<step>``. An existing checkpoint of the
            same step is replaced.

        Raises:
            CheckpointSaveError: The write failed for lack of room or another OS error; the
                partial directory is gone and a ``checkpoint_failed`` event was reported.
            Exception: Whatever else ``write`` raised; the temporary directory is removed
                first, and any earlier checkpoint of the step is left as it was.
        """
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        try:
            final = self._write(step, write, manifest_from_writer=False)
        except Exception as err:
            if not is_write_failure(err):
                raise
            raise self._failed(step, err, expected_bytes) from err
        self._prune(protect=step)
        if self.archive is not None and step % self.mirror_every == 0:
            self.archive.push(final, step)
        return final

    def _failed(
        self, step: int, err: BaseException, expected_bytes: Callable[[], int] | None
    ) -> CheckpointSaveError:
        """Reports a save that could not be written (``checkpoint_failed``) and says what it
        needs. "Full" is read from the error itself or from the free space when it failed:
        removing the partial checkpoint frees room again."""
        reason = error_line(err)
        free = free_bytes(self.root)
        full = says_no_space(err) or (
            self._free_at_failure is not None and self._free_at_failure < FULL_BELOW
        )
        newest = self.latest()
        if newest is not None:
            needed = tree_bytes(newest)
        else:
            needed = expected_bytes() if expected_bytes is not None else None
        self._event(
            "checkpoint_failed",
            step=step,
            root=str(self.root),
            disk_full=full,
            free_bytes=free,
            needed_bytes=needed,
            reason=reason,
        )
        free_text = "unknown" if free is None else f"{free / (1 << 20):.1f} MiB"
        need_text = (
            "" if needed is None else f", a checkpoint needs about {needed / (1 << 20):.1f} MiB"
        )
        return CheckpointSaveError(
            f"could not save the checkpoint of step {step} under {self.root}: "
            f"{'the disk is full' if full else 'the write failed'} ({free_text} free there"
            f"{need_text}; {reason})"
        )

    def refuse(self, step: int, reason: str, **fields: Any) -> None:
        """Records that the checkpoint of ``step`` was deliberately not written (its content
        failed the caller's health check): a ``checkpoint_refused`` event."""
        self._event("checkpoint_refused", step=step, root=str(self.root), reason=reason, **fields)

    def _write(self, step: int, write: Callable[[Path], None], manifest_from_writer: bool) -> Path:
        """Temporary directory -> files -> manifest -> fsync -> marker -> rename."""
        self._free_at_failure = None
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{STEP_PREFIX}{step}-", dir=self.root))
        try:
            write(tmp)
            if manifest_from_writer:
                problem = verify(tmp)
                if problem is not None:
                    raise ValueError(problem)
            else:
                write_manifest(tmp)
            _fsync_tree(tmp)
            marker = tmp / MARKER
            with marker.open("w", encoding="utf-8") as handle:
                json.dump({"step": step, "time": time.time()}, handle)
                handle.flush()
                os.fsync(handle.fileno())
            _fsync_dir(tmp)
            return self._publish(tmp, step)
        except BaseException:
            self._free_at_failure = free_bytes(self.root)  # before the cleanup frees room
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def mirror_metrics(self) -> dict[str, float]:
        """The uploads that ended since the last call, as step metrics:
        ``checkpoint/mirror_upload_s`` and ``checkpoint/mirror_upload_mb`` (of those that
        completed), ``checkpoint/mirror_failures``, and ``checkpoint/mirror_pending`` (queued
        or under way now); ``{}`` before the first upload."""
        return self.archive.metrics() if self.archive is not None else {}

    def abandon_mirror_after(self, step: int) -> None:
        """A rollback to ``step``: the mirror's copies of later steps lose their markers
        (no resume chooses them) behind the uploads already queued, and are deleted at the
        next upload's prune."""
        if self.archive is not None:
            self.archive.abandon_after(step)

    def finish_uploads(
        self, timeout_s: float = 600.0, grace_s: float = INTERRUPT_GRACE_S
    ) -> list[int]:
        """Waits up to ``timeout_s`` for the mirror's queued uploads (the end of a run; a
        ``mirror_waiting`` event first when there are any); the steps left unfinished are
        reported (``mirror_unfinished``) and returned. Their local checkpoints are
        untouched. SIGTERM or Ctrl-C during the wait gives the uploads ``grace_s`` more
        before it is raised again."""
        if self.archive is None:
            return []
        return self.archive.finish(timeout_s, grace_s)

    def mirror_outcome(self) -> str | None:
        """One line on the mirror's uploads that failed or did not finish in this run;
        ``None`` when there is no mirror or every upload completed."""
        return self.archive.outcome() if self.archive is not None else None

    def check_mirror(self) -> None:
        """Lists the mirror before a run relies on it (a missing bucket or folder is an empty
        mirror, which the first upload makes).

        Raises:
            UserError: The mirror cannot be listed (an endpoint down, wrong credentials).
        """
        if self.mirror is None:
            return
        try:
            self._listed = self.mirror.complete_steps()  # what --resume auto may fetch
        except Exception as err:
            raise UserError(
                f"checkpoint.mirror_url={self.mirror.url} cannot be reached ({error_line(err)}); "
                "fix its endpoint or credentials (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ... for "
                "s3://), or leave checkpoint.mirror_url empty to train without a mirror"
            ) from None

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
            match = STEP_DIR.fullmatch(entry.name)
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
            unmarked_step = STEP_DIR.fullmatch(entry.name) and not (entry / MARKER).is_file()
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

        Every checkpoint chosen is verified against its manifest first; ``auto`` reports
        each one it skips (``checkpoint_corrupt``, with the reason) and the one it takes
        (``checkpoint_verified``).

        Args:
            spec: ``"never"`` (start fresh), ``"auto"`` (the newest good checkpoint: local
                first, then the mirror's newest good copy, fetched into the local tier), or
                the path of a checkpoint directory.

        Returns:
            The checkpoint directory, or ``None`` to start from scratch.

        Raises:
            UserError: If ``spec`` is a path that is not a complete, intact checkpoint.
        """
        if spec == "never":
            return None
        if spec == "auto":
            return self.latest_good() or self._from_mirror()
        path = Path(spec)
        if not (path / MARKER).is_file():
            reason = "does not exist" if not path.exists() else f"has no {MARKER} marker"
            raise UserError(
                f"--resume {spec}: not a complete checkpoint ({reason}); "
                "expected a checkpoint directory such as checkpoints/step_<N>, or auto|never"
            )
        if not self._check(path):
            raise UserError(
                f"--resume {spec}: the checkpoint is damaged ({verify(path)}); "
                "choose another one (honing checkpoints RUN_DIR lists them)"
            )
        return path

    def _check(self, path: Path, tier: str = "local") -> bool:
        """Verifies one checkpoint and reports the verdict as an event."""
        started = time.perf_counter()
        problem = verify(path)
        seconds = round(time.perf_counter() - started, 4)
        if problem is None:
            self._event("checkpoint_verified", path=str(path), tier=tier, seconds=seconds)
            return True
        self._event("checkpoint_corrupt", path=str(path), tier=tier, reason=problem)
        return False

    def latest_good(self, at_most: int | None = None) -> Path | None:
        """The newest local checkpoint that passes its manifest, skipping (and reporting)
        damaged ones; ``None`` if there is none.

        Args:
            at_most: Only consider steps up to this one (a rollback to before a collapse).
        """
        steps = [s for s in self.complete_steps() if at_most is None or s <= at_most]
        for step in reversed(steps):
            if self._check(self.path_for(step)):
                return self.path_for(step)
        return None

    def _from_mirror(self) -> Path | None:
        """Fetches the mirror's newest good copy into the local tier, or ``None``.

        Raises:
            UserError: The mirror cannot be listed (an endpoint down, wrong credentials), or
                it holds copies and none could be fetched: starting afresh would silently
                drop the run's progress (and its pushes would overwrite those copies).
        """
        if self.mirror is None:
            return None
        try:  # the listing check_mirror just made, when it did
            steps = self._listed if self._listed is not None else self.mirror.complete_steps()
            self._listed = None
        except Exception as err:
            reason = error_line(err)
            raise UserError(
                f"--resume auto: no checkpoint under {self.root}, and the mirror "
                f"{self.mirror.url} cannot be read ({reason}); fix its endpoint or credentials "
                "(AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ... for s3://), or start afresh with "
                "--resume never"
            ) from None
        first_reason = ""
        for step in reversed(steps):
            source = self.mirror.path_for(step)
            try:
                path = self._write(
                    step, partial(self.mirror.fetch, step), manifest_from_writer=True
                )
            except Exception as err:  # damaged, or the download failed: try an older copy
                reason = error_line(err)
                first_reason = first_reason or reason
                self._event("checkpoint_corrupt", path=source, tier="mirror", reason=reason)
                continue
            self._event("checkpoint_verified", path=str(path), tier="mirror")
            self._event("checkpoint_from_mirror", step=step, source=source, path=str(path))
            return path
        if steps:
            raise UserError(
                f"--resume auto: no checkpoint under {self.root}, and none of the "
                f"{len(steps)} copies in the mirror {self.mirror.url} could be fetched and "
                f"verified (the newest: {first_reason}); fix access to the mirror, or start "
                "afresh with --resume never into another checkpoint.mirror_url"
            )
        return None
