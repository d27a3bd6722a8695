"""math-verify in worker processes, each check under a hard deadline kept by the parent.

math-verify (sympy underneath) can run for ever on some inputs (``9^{9^{9^9}}``): its own
timeouts use ``signal.alarm``, which a long big-integer operation never yields to. So each
check runs in a worker process; the parent waits on the workers' pipes with the nearest
deadline as timeout, SIGKILLs a worker whose check passes its deadline, gives that check the
verdict ``"timeout"``, and starts a replacement. math-verify's own timeouts are disabled in
the workers (``parsing_timeout=None``, ``timeout_seconds=None``).

Workers are started lazily, on the first ``check``, with the ``"spawn"`` start method: a
fresh interpreter, never a fork of a parent that may hold torch threads. They are reused
across calls and stopped by ``close()`` or at interpreter exit. A worker's address space is
capped (``memory_limit_mb``) so that a runaway fails with ``MemoryError`` instead of
swapping the machine.

Limits: the deadline runs from the moment a check is handed to a started worker (time spent
queued behind other checks, or waiting for a worker's start, is not counted); a replacement
worker takes about a second to start (importing sympy), during which the pool has one
worker fewer. One ``check`` runs at a time per pool (a lock serialises callers).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

Job = tuple[list[str], str]  # (ground truths, any of which may match; the answer)

_START_TIMEOUT_S = 60.0


@dataclass
class _Worker:
    process: Any
    connection: Connection
    started_at: float = field(default_factory=time.monotonic)
    ready: bool = False
    job: int | None = None
    dispatched_at: float = 0.0


def _worker_main(connection: Connection, memory_limit_mb: int | None) -> None:
    """Worker loop: receive ``(golds, answer)``, send ``(verdict, reason)``; ``None`` stops."""
    if memory_limit_mb:
        import resource

        limit = memory_limit_mb * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    logging.disable(logging.CRITICAL)  # math-verify logs each parse failure
    from math_verify import parse, verify

    connection.send("ready")
    while True:
        try:
            job = connection.recv()
        except EOFError:
            return
        if job is None:
            return
        try:
            connection.send(_verify(parse, verify, *job))
        except Exception as exc:  # noqa: BLE001 - one bad check must not end the worker
            connection.send(("unparsable", f"math-verify failed: {type(exc).__name__}: {exc}"))


def _verify(parse: Any, verify: Any, golds: list[str], answer: str) -> tuple[str, str]:
    predicted = parse(answer, parsing_timeout=None)
    if not predicted:
        return "unparsable", "math-verify cannot read the answer"
    parsed_any = False
    for gold in golds:
        parsed = parse(gold, parsing_timeout=None)
        parsed_any = parsed_any or bool(parsed)
        if parsed and verify(parsed, predicted, timeout_seconds=None):
            return "correct", "math-verify: equivalent to the ground truth"
    if not parsed_any:
        return "unparsable", "math-verify cannot read the ground truth"
    return "wrong", "math-verify: not equivalent to the ground truth"


def _stop(workers: list[_Worker]) -> None:
    """Stop every worker: ask politely, then SIGKILL what is still running."""
    for worker in workers:
        with contextlib.suppress(OSError, ValueError):
            worker.connection.send(None)
    for worker in workers:
        worker.process.join(timeout=0.5)
        if worker.process.is_alive():
            worker.process.kill()
            worker.process.join(timeout=1.0)
        worker.connection.close()
    workers.clear()


class MathPool:
    """A pool of math-verify worker processes with a per-check deadline.

    Args:
        workers: number of worker processes (default ``os.cpu_count()``).
        timeout_s: each check's deadline, from dispatch to a worker.
        memory_limit_mb: address-space cap of each worker (``None``: no cap).
    """

    def __init__(
        self,
        workers: int | None = None,
        timeout_s: float = 5.0,
        memory_limit_mb: int | None = 4096,
    ) -> None:
        self.size = max(1, workers or os.cpu_count() or 1)
        self.timeout_s = timeout_s
        self.memory_limit_mb = memory_limit_mb
        self._context = multiprocessing.get_context("spawn")
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _stop, self._workers)

    def check(self, jobs: list[Job]) -> list[dict[str, Any]]:
        """Verify each job in the workers; results in job order.

        Each result is ``{"verdict": "correct" | "wrong" | "unparsable" | "timeout",
        "reason": str, "elapsed_s": float}``; ``elapsed_s`` runs from dispatch to the result
        or to the kill.
        """
        with self._lock:
            while len(self._workers) < self.size:
                self._workers.append(self._start_worker())
            results: list[dict[str, Any] | None] = [None] * len(jobs)
            pending = deque(range(len(jobs)))
            while pending or any(worker.job is not None for worker in self._workers):
                self._dispatch(jobs, pending)
                self._collect(results, pending)
            lost = {"verdict": "unparsable", "reason": "no result from the pool", "elapsed_s": 0}
            return [result if result is not None else lost for result in results]

    def _start_worker(self) -> _Worker:
        parent_end, child_end = self._context.Pipe(duplex=True)
        process = self._context.Process(
            target=_worker_main, args=(child_end, self.memory_limit_mb), daemon=True
        )
        process.start()
        child_end.close()  # so that the parent sees EOF when the worker dies
        return _Worker(process, parent_end)

    def _dispatch(self, jobs: list[Job], pending: deque[int]) -> None:
        for worker in self._workers:
            if worker.ready and worker.job is None and pending:
                worker.job = pending.popleft()
                worker.dispatched_at = time.monotonic()
                worker.connection.send(jobs[worker.job])

    def _collect(self, results: list[dict[str, Any] | None], pending: deque[int]) -> None:
        """Wait for the next message or deadline; record results, replace dead workers."""
        now = time.monotonic()
        deadlines = [
            worker.dispatched_at + self.timeout_s
            if worker.job is not None
            else worker.started_at + _START_TIMEOUT_S
            for worker in self._workers
            if worker.job is not None or not worker.ready
        ]
        waiting = [w.connection for w in self._workers if w.job is not None or not w.ready]
        wait(waiting, timeout=max(0.0, min(deadlines) - now) if deadlines else 0.0)
        for index, worker in enumerate(self._workers):
            if worker.job is None and worker.ready:
                continue
            message = self._receive(worker)
            elapsed = time.monotonic() - worker.dispatched_at
            if message == "ready":
                worker.ready = True
            elif message is not None:
                verdict, reason = message
                results[worker.job] = {"verdict": verdict, "reason": reason, "elapsed_s": elapsed}
                worker.job = None
            elif worker.job is not None and elapsed >= self.timeout_s:
                results[worker.job] = {
                    "verdict": "timeout",
                    "reason": f"math-verify ran past the {self.timeout_s:g} s deadline; killed",
                    "elapsed_s": elapsed,
                }
                self._replace(index)
            elif not worker.process.is_alive() or (
                not worker.ready and time.monotonic() - worker.started_at > _START_TIMEOUT_S
            ):
                self._fail_dead(index, results, pending)

    @staticmethod
    def _receive(worker: _Worker) -> Any:
        """The worker's next message if one is waiting, else ``None`` (also when it died)."""
        try:
            return worker.connection.recv() if worker.connection.poll() else None
        except (EOFError, OSError):
            return None

    def _fail_dead(self, index: int, results: list, pending: deque[int]) -> None:
        """A worker died (crash, memory) or never started: fail its job, or all if unstartable."""
        worker = self._workers[index]
        exitcode = worker.process.exitcode
        if worker.job is not None:
            results[worker.job] = {
                "verdict": "unparsable",
                "reason": f"math-verify worker died (exit code {exitcode})",
                "elapsed_s": time.monotonic() - worker.dispatched_at,
            }
            self._replace(index)
            return
        reason = f"math-verify worker failed to start (exit code {exitcode})"
        while pending:
            results[pending.popleft()] = {"verdict": "unparsable", "reason": reason, "elapsed_s": 0}
        self._replace(index)

    def _replace(self, index: int) -> None:
        worker = self._workers[index]
        worker.process.kill()  # SIGKILL: a runaway big-integer operation ignores anything else
        worker.process.join(timeout=1.0)
        worker.connection.close()
        self._workers[index] = self._start_worker()

    def close(self) -> None:
        """Stop the workers; the pool starts new ones if used again."""
        with self._lock:
            _stop(self._workers)

    def __enter__(self) -> MathPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
