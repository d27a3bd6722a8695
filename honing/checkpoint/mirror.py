"""The archive tier: copies of checkpoints at an fsspec URL (a local path, ``file://``, ``s3://``).

The local ``RUN_DIR/checkpoints`` is the hot tier (every save, few kept); the mirror gets every
M-th checkpoint and keeps the newest ``mirror_keep`` (all by default), so losing the run's
disk loses at most M saves. A copy follows the local discipline as far as object stores
allow (an object store has no rename of a directory): the files go to ``URL/step_<N>/`` and
the ``COMPLETE`` marker is written last, so a copy interrupted at any moment has no marker and
is never chosen; a copy of the same step already there loses its marker before anything
else. ``manifest.json`` travels with the files, so a copy that came back damaged is caught
when it is verified.

Uploads run on a thread of their own (``Uploader``), so a step never waits for the network:
the checkpoint is first hard-linked into ``.tmp-mirror-step_<N>-*`` beside it (its files are
never rewritten, so the links hold the content even when retention deletes the checkpoint),
then pushed, oldest first, with ``attempts`` tries each. A failure is an event; the local
copy stands either way.

S3: ``s3://bucket/prefix`` through ``s3fs`` (``pip install 'honing[s3]'``), with credentials,
region and endpoint from the standard AWS environment variables (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_DEFAULT_REGION``, ``AWS_ENDPOINT_URL`` for MinIO, moto or
another S3 API) or the AWS config files.

Limits: one writer per mirror URL (point each run at its own); local mirrors are not fsync-ed
(verification catches what a power loss tears).
"""

from __future__ import annotations

import os
import posixpath
import queue
import re
import secrets
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from honing.errors import ConfigError

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
        try:
            # a filesystem of its own: one cached by fsspec may hold another endpoint
            self.fs, self.root = fsspec.core.url_to_fs(url, skip_instance_cache=True)
        except ImportError as err:  # fsspec names the package its protocol needs
            extra = " (pip install 'honing[s3]')" if url.startswith(("s3://", "s3a://")) else ""
            raise ConfigError(f"checkpoint.mirror_url={url}: {err}{extra}") from None
        except ValueError as err:  # an unknown protocol
            raise ConfigError(f"checkpoint.mirror_url={url}: {err}") from None

    def path_for(self, step: int) -> str:
        """Where the copy of ``step`` lives in the mirror's filesystem."""
        return posixpath.join(self.root, f"step_{step}")

    def push(self, local: Path, step: int) -> str:
        """Copies the complete local checkpoint ``local`` to ``step_<step>``, marker last.

        An existing copy of the step is replaced (its marker goes first).

        Returns:
            The copy's path in the mirror's filesystem.

        Raises:
            OSError: Or any fsspec error; the copy then has no marker.
        """
        self.fs.makedirs(self.root, exist_ok=True)
        final = self.path_for(step)
        self._remove(final)
        for path in sorted(p for p in local.rglob("*") if p.is_file() and p.name != MARKER):
            target = posixpath.join(final, path.relative_to(local).as_posix())
            self.fs.makedirs(posixpath.dirname(target), exist_ok=True)
            self.fs.put_file(str(path), target)
        self.fs.put_file(str(local / MARKER), posixpath.join(final, MARKER))
        return final

    def _remove(self, path: str) -> None:
        """Deletes a copy, its marker first: a copy half deleted is never taken for a good
        one."""
        if not self.fs.exists(path):
            return
        marker = posixpath.join(path, MARKER)
        if self.fs.exists(marker):
            self.fs.rm(marker)
        self.fs.rm(path, recursive=True)

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

    def check(self) -> str:
        """Writes, reads back and deletes a probe object under the mirror's root (``honing
        doctor``); says what copies the mirror holds.

        Raises:
            Any fsspec or OS error: the mirror cannot be written (endpoint, credentials).
        """
        self.fs.makedirs(self.root, exist_ok=True)
        probe = posixpath.join(self.root, f"{TMP_PREFIX}probe-{secrets.token_hex(4)}")
        self.fs.pipe_file(probe, b"honing")
        try:
            if self.fs.cat_file(probe) != b"honing":
                raise OSError(f"{self.url}: a probe object read back different bytes")
        finally:
            self.fs.rm(probe)
        steps = self.complete_steps()
        held = f"{len(steps)} complete copies, newest step {steps[-1]}" if steps else "empty"
        return f"{self.url} writable ({held})"

    def prune(self, keep: int, protect: int) -> list[int]:
        """Deletes the oldest complete copies beyond the newest ``keep``, never ``protect``
        (the copy just pushed); returns their steps."""
        steps = self.complete_steps()
        doomed = [s for s in steps[: max(len(steps) - keep, 0)] if s != protect]
        for step in doomed:
            self._remove(self.path_for(step))
        return doomed

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


@dataclass
class Upload:
    """What became of one checkpoint's upload.

    Attributes:
        step: the checkpoint's step. ok: whether the copy is complete in the mirror.
        seconds: from the first try's start to the end of the last. bytes: of the files.
        attempts: tries made. detail: the copy's path, or the last try's error.
        pruned: steps of older copies removed by ``mirror_keep`` after it.
    """

    step: int
    ok: bool
    seconds: float
    bytes: int
    attempts: int
    detail: str
    pruned: list[int]


class Uploader:
    """Pushes checkpoints to a ``Mirror`` on a thread of its own, in the order given.

    Args:
        mirror: where the copies go.
        keep: copies the mirror keeps (0 = all), applied after each successful push.
        attempts: tries per checkpoint; a try that fails waits ``backoff_s`` × its number.
        on_done: called on the upload thread with each ``Upload`` as it ends.
    """

    def __init__(
        self,
        mirror: Mirror,
        keep: int = 0,
        *,
        attempts: int = 3,
        backoff_s: float = 1.0,
        on_done: Callable[[Upload], None] | None = None,
    ) -> None:
        self.mirror, self.keep = mirror, keep
        self.attempts, self.backoff_s = max(attempts, 1), backoff_s
        self.on_done = on_done
        self._queue: queue.Queue[tuple[Path, int] | None] = queue.Queue()
        self._finished: list[Upload] = []
        self._lock = threading.Lock()
        self._pending = 0
        self._current: int | None = None  # the step under way
        self._idle = threading.Condition(self._lock)
        self._thread = threading.Thread(target=self._work, name="honing-mirror", daemon=True)
        self._thread.start()

    def submit(self, local: Path, step: int) -> None:
        """Queues a copy of the complete checkpoint ``local``: its files are hard-linked
        (copied where links are refused) into a staging directory beside it first, so the
        upload sees them as they are now, whatever retention does next."""
        staging = local.with_name(f"{TMP_PREFIX}mirror-{local.name}-{secrets.token_hex(4)}")
        try:
            shutil.copytree(local, staging, copy_function=_link_or_copy)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        with self._lock:
            self._pending += 1
        self._queue.put((staging, step))

    @property
    def pending(self) -> int:
        """Uploads queued or under way."""
        with self._lock:
            return self._pending

    def take(self) -> list[Upload]:
        """The uploads that ended since the last call, in order."""
        with self._lock:
            done, self._finished = self._finished, []
        return done

    def close(self, timeout_s: float) -> list[int]:
        """Waits up to ``timeout_s`` for the queued uploads, then stops the thread; returns
        the steps still unfinished (their staging directories are left to the next start's
        clean-up, their local checkpoints untouched)."""
        deadline = time.monotonic() + timeout_s
        with self._idle:
            while self._pending and time.monotonic() < deadline:
                self._idle.wait(timeout=max(deadline - time.monotonic(), 0.0))
        unfinished = []
        while True:  # what never started is dropped
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                unfinished.append(item[1])
                shutil.rmtree(item[0], ignore_errors=True)
        self._queue.put(None)
        with self._lock:
            if self._pending > len(unfinished) and self._current is not None:
                unfinished.append(self._current)
        return sorted(unfinished)

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            staging, step = item
            with self._lock:
                self._current = step
            upload = self._push(staging, step)
            shutil.rmtree(staging, ignore_errors=True)
            if self.on_done is not None:
                self.on_done(upload)
            with self._idle:
                self._current = None
                self._finished.append(upload)
                self._pending -= 1
                self._idle.notify_all()

    def _push(self, staging: Path, step: int) -> Upload:
        size = sum(p.stat().st_size for p in staging.rglob("*") if p.is_file())
        started, detail = time.perf_counter(), ""
        for attempt in range(1, self.attempts + 1):
            try:
                path = self.mirror.push(staging, step)
                pruned = self.mirror.prune(self.keep, protect=step) if self.keep else []
                seconds = time.perf_counter() - started
                return Upload(step, True, seconds, size, attempt, path, pruned)
            except Exception as err:  # the endpoint, the network, the credentials
                detail = f"{type(err).__name__}: {err}".splitlines()[0]
                if attempt < self.attempts:
                    time.sleep(self.backoff_s * attempt)
        return Upload(step, False, time.perf_counter() - started, size, self.attempts, detail, [])


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)
