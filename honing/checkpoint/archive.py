"""The run's side of the mirror: its uploads queued, reported and awaited.

``CheckpointManager`` hands each mirrored checkpoint to an ``Archive``, which starts the
``Uploader`` thread on the first push, turns each ended upload into an event
(``checkpoint_mirrored``, ``mirror_failed``) and step metrics, waits for the queue at the end
of the run (``mirror_waiting``, then ``mirror_unfinished`` for what did not end) and keeps the
run's tally for one closing line (``outcome``).

SIGTERM or Ctrl-C during that wait does not cut it short: the uploads get ``grace_s`` more
(what a run interrupted mid-step gets), then the unfinished ones are reported and their
staging directories removed before the interrupt goes on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from honing.checkpoint.mirror import Mirror, Upload, Uploader
from honing.errors import error_line

EventSink = Callable[..., None]


class Archive:
    """Uploads to ``mirror`` in the background and reports them to ``on_event``.

    Args:
        mirror: where the copies go.
        keep: copies the mirror keeps (0 = all).
        attempts, backoff_s: tries per upload, and the wait after the n-th failed one
            (n × this); ``retry`` holds them, read when the uploader starts.
        on_event: ``on_event(kind, **fields)``; called from the upload thread too.
    """

    def __init__(
        self,
        mirror: Mirror,
        keep: int,
        attempts: int,
        backoff_s: float,
        on_event: EventSink,
    ) -> None:
        self.mirror, self.keep = mirror, keep
        self.retry = (attempts, backoff_s)
        self.on_event = on_event
        self.uploader: Uploader | None = None  # started by the first push
        self.mirrored = 0
        self.failed: list[Upload] = []
        self.unfinished: list[int] = []

    def push(self, local: Path, step: int) -> None:
        """Queues a fresh checkpoint's upload; a failure is reported (an event), never
        raised: the local checkpoint stands and the next push tries again."""
        try:
            self._start().submit(local, step)
        except OSError as err:  # no room for the staging links
            upload = Upload(step, False, 0.0, 0, 0, error_line(err), [])
            self._uploaded(upload)

    def abandon_after(self, step: int) -> None:
        """A rollback to ``step``: the mirror's copies of later steps lose their markers
        behind the uploads already queued."""
        self._start().abandon_after(step)

    def _start(self) -> Uploader:
        if self.uploader is None:
            attempts, backoff_s = self.retry
            self.uploader = Uploader(
                self.mirror,
                self.keep,
                attempts=attempts,
                backoff_s=backoff_s,
                on_done=self._uploaded,
            )
        return self.uploader

    def _uploaded(self, upload: Upload) -> None:
        if upload.ok:
            self.mirrored += 1
            self.on_event(
                "checkpoint_mirrored",
                step=upload.step,
                path=upload.detail,
                seconds=round(upload.seconds, 3),
                bytes=upload.bytes,
                attempts=upload.attempts,
                pruned=upload.pruned,
            )
        else:
            self.failed.append(upload)
            self.on_event(
                "mirror_failed",
                step=upload.step,
                url=self.mirror.url,
                reason=upload.detail,
                attempts=upload.attempts,
            )

    def metrics(self) -> dict[str, float]:
        """The uploads that ended since the last call, as step metrics (see
        ``CheckpointManager.mirror_metrics``); ``{}`` while no uploader runs."""
        if self.uploader is None:
            return {}
        done = self.uploader.take()
        good = [u for u in done if u.ok]
        metrics = {
            "checkpoint/mirror_pending": float(self.uploader.pending),
            "checkpoint/mirror_failures": float(len(done) - len(good)),
        }
        if good:
            metrics["checkpoint/mirror_upload_s"] = sum(u.seconds for u in good)
            metrics["checkpoint/mirror_upload_mb"] = sum(u.bytes for u in good) / 2**20
        return metrics

    def finish(self, timeout_s: float, grace_s: float) -> list[int]:
        """Waits up to ``timeout_s`` for the queue, then stops the uploader; returns the steps
        left unfinished (a ``mirror_unfinished`` event). An interrupt during the wait gives
        the uploads ``grace_s`` more (a second one ends the grace), then is raised again."""
        if self.uploader is None:
            return []
        uploader, started = self.uploader, time.monotonic()
        if pending := uploader.pending:
            url = self.mirror.url
            self.on_event("mirror_waiting", uploads=pending, url=url, at_most_s=timeout_s)
        try:
            uploader.wait(timeout_s)
        except KeyboardInterrupt:
            try:
                uploader.wait(min(grace_s, max(timeout_s - (time.monotonic() - started), 0.0)))
            finally:
                self._stop(time.monotonic() - started)
            raise
        return self._stop(time.monotonic() - started)

    def _stop(self, waited_s: float) -> list[int]:
        unfinished = self.uploader.close()
        self.uploader = None
        if unfinished:
            self.unfinished += unfinished
            self.on_event(
                "mirror_unfinished",
                steps=unfinished,
                url=self.mirror.url,
                waited_s=round(waited_s, 1),
            )
        return unfinished

    def outcome(self) -> str | None:
        """One line on the uploads that failed or did not finish during the run; ``None``
        when every one completed."""
        if not self.failed and not self.unfinished:
            return None
        parts: list[Any] = []
        if self.failed:
            steps = ", ".join(str(u.step) for u in self.failed)
            parts.append(
                f"{len(self.failed)} of {self.mirrored + len(self.failed)} uploads failed "
                f"(steps {steps}; the last: {self.failed[-1].detail})"
            )
        if self.unfinished:
            steps = ", ".join(map(str, sorted(self.unfinished)))
            parts.append(f"{len(self.unfinished)} did not finish (steps {steps})")
        return (
            f"checkpoint.mirror_url={self.mirror.url}: {'; '.join(parts)}; the local "
            "checkpoints stand (events.jsonl: mirror_failed, mirror_unfinished)"
        )
