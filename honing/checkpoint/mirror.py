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
then pushed, oldest first, with ``attempts`` tries each; after an upload failed every try,
the next ones get one try each until one succeeds, so a mirror that is down costs one try per
checkpoint. A failure is an event; the local copy stands either way.

S3: ``s3://bucket/prefix`` through ``s3fs`` (``pip install 'honing[s3]'``), with credentials,
region and endpoint from the standard AWS environment variables (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_DEFAULT_REGION``, ``AWS_ENDPOINT_URL`` for MinIO, moto or
another S3 API) or the AWS config files. Each request waits at most s3fs's timeouts (5 s to
connect, 15 s for an answer) and is tried twice by botocore (``AWS_MAX_ATTEMPTS`` overrides),
never again by s3fs: a failed upload is tried again whole, by the ``Uploader``.

Limits: one writer per mirror URL (point each run at its own); local mirrors are not fsync-ed
(verification catches what a power loss tears).
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import re
import secrets
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from honing.checkpoint.disk import nearest_existing, tree_bytes
from honing.checkpoint.manifest import MARKER, STEP_DIR, TMP_PREFIX
from honing.errors import ConfigError, error_line

S3_SCHEMES = ("s3", "s3a")
S3_REQUEST_ATTEMPTS = 2  # botocore's tries per request, unless AWS_MAX_ATTEMPTS is set
# S3's rules for a bucket name: 3-63 characters, lowercase letters, digits, dots and hyphens,
# a letter or digit at each end, no two dots in a row, not an IP address
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_IP = re.compile(r"\d+\.\d+\.\d+\.\d+")
EXPECTED = "expected a directory path, file://PATH, s3://bucket/prefix or another fsspec URL"


def url_problem(url: str) -> str | None:
    """What is wrong with a mirror URL on its face, without reaching it: a path that is a
    file (or lies under one), an ``s3://`` URL without a valid bucket name, a protocol
    fsspec does not know; ``None`` when nothing is."""
    import fsspec

    scheme, sep, rest = url.partition("://")
    if not sep or scheme == "file":
        return _path_problem(Path(rest if sep else url).expanduser())
    if scheme in S3_SCHEMES:
        bucket = rest.split("/", 1)[0]
        if not bucket:
            return "names no bucket; expected s3://bucket/prefix"
        if not _BUCKET.fullmatch(bucket) or ".." in bucket or _IP.fullmatch(bucket):
            return (
                f"{bucket!r} is not a valid S3 bucket name (3-63 lowercase letters, digits, "
                "dots and hyphens, a letter or digit at each end); expected s3://bucket/prefix"
            )
        return None
    if scheme not in fsspec.available_protocols():
        return f"{scheme}:// is not a protocol fsspec knows; {EXPECTED}"
    return None


def _path_problem(path: Path) -> str | None:
    probe = nearest_existing(path)
    if probe.exists() and not probe.is_dir():
        return f"{probe} is a file; {EXPECTED}"
    return None


class Mirror:
    """A second home for checkpoints, at ``url``.

    Args:
        url: An fsspec URL or a local path; the directory that will hold ``step_<N>/``.
    """

    def __init__(self, url: str) -> None:
        import fsspec  # only runs that mirror pay for the import

        self.url = url
        problem = url_problem(url)
        if problem is not None:
            raise ConfigError(f"checkpoint.mirror_url={url}: {problem}")
        s3 = url.partition("://")[0] in S3_SCHEMES
        options = {}
        if s3 and "AWS_MAX_ATTEMPTS" not in os.environ:
            retries = {"max_attempts": S3_REQUEST_ATTEMPTS, "mode": "standard"}
            options["config_kwargs"] = {"retries": retries}
        try:
            # a filesystem of its own: one cached by fsspec may hold another endpoint
            self.fs, self.root = fsspec.core.url_to_fs(url, skip_instance_cache=True, **options)
        except ImportError as err:  # fsspec names the package its protocol needs
            extra = " (pip install 'honing[s3]')" if s3 else ""
            raise ConfigError(f"checkpoint.mirror_url={url}: {err}{extra}") from None
        except Exception as err:  # an unknown protocol, a host that does not resolve (ftp://)
            raise ConfigError(
                f"checkpoint.mirror_url={url}: cannot open it ({error_line(err)}); {EXPECTED}"
            ) from None
        if s3:  # s3fs's own retries off: the Uploader tries a failed upload again whole
            self.fs.retries = 1

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
        """Steps of the copies that hold a marker, ascending ([] when the mirror is empty).

        Raises:
            Any fsspec or OS error but ``FileNotFoundError``: the mirror cannot be listed.
        """
        return sorted(step for step, marked in self._copies() if marked)

    def _copies(self) -> list[tuple[int, bool]]:
        """Every ``step_<N>`` in the mirror, with whether it holds its marker."""
        try:
            # not exists(): s3fs answers False for a bucket it cannot reach
            entries = self.fs.ls(self.root, detail=False, refresh=True)
        except FileNotFoundError:
            return []
        copies = []
        for entry in entries:
            match = STEP_DIR.fullmatch(posixpath.basename(entry.rstrip("/")))
            if match:
                copies.append((int(match.group(1)), self.fs.exists(posixpath.join(entry, MARKER))))
        return copies

    def check(self) -> str:
        """Writes, reads back and deletes a probe object under the mirror's root (``honing
        doctor``); says what copies the mirror holds.

        Raises:
            Any fsspec or OS error: the mirror cannot be written (endpoint, credentials).
        """
        if _is_local(self.fs):  # an object store's bucket is not made here: a typo would be
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
        """Deletes the oldest complete copies beyond the newest ``keep`` (0 = keep all),
        never ``protect`` (the copy just pushed), and every copy without its marker (a push
        cut off, a copy abandoned by a rollback; one writer per URL, so none is under way);
        returns the steps of the complete copies removed."""
        copies = self._copies()
        for step, marked in copies:
            if not marked and step != protect:
                self._remove(self.path_for(step))
        steps = sorted(step for step, marked in copies if marked)
        doomed = [s for s in steps[: max(len(steps) - keep, 0)] if s != protect] if keep else []
        for step in doomed:
            self._remove(self.path_for(step))
        return doomed

    def abandon_after(self, step: int) -> list[int]:
        """Takes the markers off the copies of steps after ``step`` (a rollback's abandoned
        stretch), so that no resume chooses them; their files go at the next prune."""
        later = [s for s in self.complete_steps() if s > step]
        for later_step in later:
            self.fs.rm(posixpath.join(self.path_for(later_step), MARKER))
        return later

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
            After an upload failed every try, the next ones get one try each until one
            succeeds.
        on_done: called on the upload thread with each ``Upload`` as it ends, until
            ``close``; what it raises is dropped (an upload never stops the others).
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
        self._lock = threading.Condition()  # guards everything below; notified on changes
        self._queue: deque[tuple[Path, int] | tuple[None, int]] = deque()
        self._finished: list[Upload] = []
        self._current: int | None = None  # the step whose upload is under way
        self._staging: Path | None = None  # and where its files are
        self._busy = False  # an item (an upload or an abandon) is under way
        self._closed = False
        self._failing = False  # the last upload failed every try
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
        self._put((staging, step))

    def abandon_after(self, step: int) -> None:
        """Queues the removal of the mirror's copies of steps after ``step`` (a rollback
        left them behind), behind the uploads already queued."""
        self._put((None, step))

    def _put(self, item) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("the uploader is closed")
            self._queue.append(item)
            self._lock.notify_all()

    @property
    def pending(self) -> int:
        """Uploads queued or under way."""
        with self._lock:
            queued = sum(staging is not None for staging, _ in self._queue)
            return queued + (self._current is not None)

    def take(self) -> list[Upload]:
        """The uploads that ended since the last call, in order."""
        with self._lock:
            done, self._finished = self._finished, []
        return done

    def wait(self, timeout_s: float) -> bool:
        """Waits up to ``timeout_s`` for the queued work to end; returns whether it did. An
        interrupt (Ctrl-C, SIGTERM) ends the wait and is raised; the uploads go on."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while (self._queue or self._busy) and time.monotonic() < deadline:
                self._lock.wait(timeout=max(deadline - time.monotonic(), 0.0))
            return not (self._queue or self._busy)

    def close(self, timeout_s: float = 0.0) -> list[int]:
        """Waits up to ``timeout_s`` for the queued work (``wait``), then stops the thread;
        returns the steps whose uploads did not end. The queued ones are dropped and the one
        under way is cut off (its copy gets no marker, so it is never chosen, and the next
        prune deletes it), their staging directories removed; their local checkpoints are
        untouched."""
        if timeout_s > 0:
            self.wait(timeout_s)
        with self._lock:
            self._closed = True
            dropped, self._queue = list(self._queue), deque()
            unfinished = [] if self._current is None else [self._current]
            cut = self._staging if self._current is not None else None
            self._lock.notify_all()
        for staging, step in dropped:
            if staging is not None:
                unfinished.append(step)
                shutil.rmtree(staging, ignore_errors=True)
        if cut is not None:
            shutil.rmtree(cut, ignore_errors=True)
        return sorted(unfinished)

    def _work(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._lock.wait()
                if self._closed:
                    return
                staging, step = self._queue.popleft()
                self._busy, self._current = True, step if staging is not None else None
                self._staging = staging
            upload = None
            try:
                if staging is None:
                    with contextlib.suppress(Exception):  # the next push's prune tries again
                        self.mirror.abandon_after(step)
                else:
                    upload = self._push(staging, step)
            finally:
                if staging is not None:
                    shutil.rmtree(staging, ignore_errors=True)
                # reported while still busy, so that a wait for the queue covers the report
                if upload is not None and self.on_done is not None and not self._closed:
                    with contextlib.suppress(Exception):  # a closed log must not stop uploads
                        self.on_done(upload)
                with self._lock:
                    self._busy, self._current, self._staging = False, None, None
                    if upload is not None:
                        self._finished.append(upload)
                        self._failing = not upload.ok
                    self._lock.notify_all()

    def _push(self, staging: Path, step: int) -> Upload:
        started, detail, size = time.perf_counter(), "", tree_bytes(staging)
        attempts = 1 if self._failing else self.attempts
        for attempt in range(1, attempts + 1):
            try:
                path = self.mirror.push(staging, step)
                pruned = self.mirror.prune(self.keep, protect=step)
                seconds = time.perf_counter() - started
                return Upload(step, True, seconds, size, attempt, path, pruned)
            except Exception as err:  # the endpoint, the network, the credentials
                detail = error_line(err)
                if self._closed:  # cut off by close: no more tries
                    return Upload(
                        step, False, time.perf_counter() - started, size, attempt, detail, []
                    )
                if attempt < attempts:
                    time.sleep(self.backoff_s * attempt)
        return Upload(step, False, time.perf_counter() - started, size, attempts, detail, [])


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def _is_local(fs) -> bool:
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return "file" in protocols or "local" in protocols
