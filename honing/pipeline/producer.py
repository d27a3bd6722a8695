"""Rollouts produced ahead of the trainer: the ``one_step`` and ``async`` schedules.

Two stages run beside the trainer, each on its own thread, with their own copy of the policy
in the rollout engine:

- generation, step after step: for step k it waits for admission, loads the weights it is
  to sample with, draws the step's prompts and samples the groups;
- scoring, on ``max_staleness + 1`` threads (at most ``MAX_SCORERS``), each with its own
  scorer (a scorer records per-call latencies and counters, so threads do not share one):
  each generated batch is scored while the next ones are generated and scored (a slow
  verifier or reward service then overlaps generation, other batches' scoring and the
  update instead of stalling them), its rewards shaped and every sample filed as kept,
  filtered or failed (``collect.score_round``).

The trainer takes step k's batch in order (``take``), updates, and publishes the new weights
(``publish``). A rollout made with weight version v is trained at step k with staleness
``(k - 1) - v`` (the trainer holds version k - 1 before its k-th update). Admission keeps it
within ``schedule.max_staleness``: generation for step k starts only once version
``k - 1 - max_staleness`` is published, so at most ``max_staleness + 1`` batches are ahead.

- ``one_step`` samples step k with exactly version ``k - 2`` (verl's one-step off-policy):
  generation of batch k + 1 overlaps the update on batch k, and the run is deterministic.
- ``async`` samples with the newest published version when generation starts (fresher, but
  which version depends on timing); staleness is at most ``max_staleness``.

A batch that arrives staler than allowed (possible only when versions move backwards, e.g. a
remote engine behind) is dropped and counted as ``samples/stale``. The loss corrects the
off-policy rest with the behaviour logprobs each rollout carries (``algorithm.tis_level``).
Not supported here yet (``rules.check_config`` says so): dynamic sampling and ReMax, whose
extra generation rounds depend on the scores of the first.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass, replace
from functools import partial

from honing.config import Config
from honing.pipeline.collect import Collected, Generated, generate_round, score_round
from honing.pipeline.components import Components
from honing.pipeline.inputs import build_scorer
from honing.pipeline.partial import PartialPool
from honing.rollout.base import GenerationRequest, WeightBucket, WeightStream

STOP = object()  # a scoring thread's end-of-work marker
MAX_SCORERS = 4  # scoring threads at most (each holds a scorer: clients, worker pools)


@dataclass
class Produced:
    """Step ``step``'s batch, the weight version that sampled it and the data cursor before
    its prompts were drawn (what a checkpoint taken before this step must record)."""

    step: int
    version: int
    source_state: dict
    collected: Collected


class RolloutProducer:
    """Generates and scores steps ``start+1 .. total`` ahead of the trainer (see the module).

    Args:
        config: the run's config (``schedule``, ``rollout``, ``algorithm``, ``reward``).
        parts: the run's components; the producer uses ``parts.engine``'s detached copy,
            ``parts.source`` (it alone draws prompts while it runs), ``parts.scorer``.
        start: the step the trainer has completed (its weights are version ``start``).
        seed_of: the sampling seed of a step.
    """

    def __init__(self, config: Config, parts: Components, start: int, seed_of):
        schedule = config.schedule
        self.config, self.seed_of = config, seed_of
        self.mode, self.max_staleness = schedule.mode, schedule.max_staleness
        if self.mode == "one_step":
            self.max_staleness = 1
        self.engine = parts.engine.detached_copy()
        self.parts = replace(parts, engine=self.engine)
        self.start, self.total = start, config.trainer.total_steps
        self._lock = threading.Condition()
        # version -> its buckets (None: the engine's own at the start)
        self._published: dict[int, list[WeightBucket] | None] = {start: None}
        self._trained = start  # the newest published version
        self._cursors: dict[int, dict] = {}  # step -> data cursor before its prompts
        self._ready: dict[int, Produced] = {}
        self._error: BaseException | None = None
        self._stopping = False
        self.engine_idle_s = 0.0  # generation's waits for admission, since the last take
        self._in_hand = 0  # samples generated and not yet handed to the scorers
        self._to_score: queue.Queue = queue.Queue(maxsize=1)
        self.pool = None  # schedule.partial_rollout: the groups in flight (pipeline/partial)
        self._emitted: dict[int, list] = {}  # partial: step -> its batch's prompts
        if schedule.partial_rollout:
            rollout = config.rollout
            self.pool = PartialPool(
                self.parts,
                group_size=rollout.group_size,
                batch_size=rollout.batch_size,
                chunk_tokens=schedule.partial_chunk_tokens,
                max_staleness=self.max_staleness,
                keep_kv=schedule.partial_kv == "keep",
            )
        count = min(self.max_staleness + 1, MAX_SCORERS)
        make = parts.make_scorer or (lambda: build_scorer(config))
        self._scorers = [parts.scorer] + [make() for _ in range(count - 1)]
        self._threads = [
            threading.Thread(target=self._guard(self._generate), name="honing-gen", daemon=True)
        ] + [
            threading.Thread(
                target=self._guard(self._score),
                args=(replace(self.parts, scorer=scorer),),
                name=f"honing-score-{index}",
                daemon=True,
            )
            for index, scorer in enumerate(self._scorers)
        ]
        for thread in self._threads:
            thread.start()

    # -- the trainer's side -------------------------------------------------------------

    def take(self, step: int) -> tuple[Collected, dict[str, float]]:
        """Step ``step``'s batch (blocking until it is scored) and the schedule's metrics."""
        t0 = time.perf_counter()
        with self._lock:
            while step not in self._ready and self._error is None:
                self._lock.wait()
            self._raise_if_failed()
            produced = self._ready.pop(step)
            depth = len(self._ready)
            engine_idle, self.engine_idle_s = self.engine_idle_s, 0.0
        got = produced.collected
        staleness = (step - 1) - produced.version
        stale = 0
        if self.pool is not None and staleness > self.max_staleness:  # partial: by sample
            kept = [
                (r, s) for r, s in got.kept if step - 1 - r.weight_version <= self.max_staleness
            ]
            stale = len(got.kept) - len(kept)
            groups = len({r.group_index for r, _ in kept})
            got = replace(got, kept=kept, groups_kept=groups)
        elif staleness > self.max_staleness:  # drop, and count, every sample of the batch
            stale = len(got.rollouts)
            got = replace(got, kept=[], failed=0, filtered=Counter(), groups_kept=0)
        return got, {
            "async/staleness": float(staleness),
            "async/weight_version": float(produced.version),
            "async/queue_depth": float(depth),
            "samples/stale": stale,
            "timing_s/trainer_idle": time.perf_counter() - t0,
            "timing_s/engine_idle": engine_idle,
        }

    def publish(self, version: int, weights: list[WeightBucket]) -> None:
        """The trainer's weights after update ``version``, as buckets of (name, tensor)
        pieces the trainer will not modify (``weight_sync.snapshot``)."""
        with self._lock:
            self._published[version] = weights
            self._trained = version
            self._lock.notify_all()

    def source_state(self, next_step: int) -> dict:
        """The data cursor a checkpoint after step ``next_step - 1`` must record: the one
        before the prompts of ``next_step`` were drawn (later batches are regenerated). With
        partial rollouts: the cursor after every prompt drawn so far, with those drawn and
        not trained yet (in the pool, or in batches from ``next_step`` on) to serve again."""
        with self._lock:
            if self.pool is not None:
                pending = [
                    p for s, ps in sorted(self._emitted.items()) if s >= next_step for p in ps
                ]
                return self.parts.source.state_dict(requeue=pending + self.pool.prompts())
            if next_step in self._cursors:
                return self._cursors[next_step]
            return self.parts.source.state_dict()  # generation has not drawn them yet

    def close(self) -> int:
        """Stops both threads; returns the samples generated but not taken (discarded)."""
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        self._threads[0].join()
        scoring = self._threads[1:]
        for _ in scoring:
            while any(thread.is_alive() for thread in scoring):  # dead scorers leave it full
                try:
                    self._to_score.put(STOP, timeout=0.1)
                    break
                except queue.Full:
                    continue
        for thread in scoring:
            thread.join()
        for scorer in self._scorers[1:]:  # the first is the run's own, closed with the run
            scorer.close()
        with self._lock:
            held = 0 if self.pool is None else sum(len(g.samples) for g in self.pool.groups)
            held += self._in_hand
            return held + sum(len(p.collected.rollouts) for p in self._ready.values())

    # -- the threads --------------------------------------------------------------------

    def _guard(self, target):
        def run(*args):
            try:
                target(*args)
            except BaseException as err:  # noqa: BLE001 - handed to the trainer's thread
                with self._lock:
                    self._error = err
                    self._lock.notify_all()

        return run

    def _raise_if_failed(self) -> None:
        """Re-raises a thread's exception in the trainer's thread, as it was (a reward or
        engine error then stops the run exactly as under the sync schedule)."""
        if self._error is not None:
            raise self._error

    def _weights_for(self, step: int) -> int | None:
        """The version step ``step`` samples with, once admitted; None while it must wait."""
        oldest = max(self.start, step - 1 - self.max_staleness)
        if self._trained < oldest:
            return None
        return oldest if self.mode == "one_step" else self._trained

    def _generate(self) -> None:
        for step in range(self.start + 1, self.total + 1):
            waited = time.perf_counter()
            with self._lock:
                while not self._stopping and (version := self._weights_for(step)) is None:
                    self._lock.wait()
                if self._stopping:
                    return
                weights = self._published[version]
                self._release_before(version)
                self.engine_idle_s += time.perf_counter() - waited
                self._cursors[step] = self.parts.source.state_dict()
                for old in [s for s in self._cursors if s < step - self.max_staleness - 2]:
                    del self._cursors[old]
                    self._emitted.pop(old, None)
            self._load(version, weights)
            if self.pool is not None:
                generated = self._partial_batch(step)
                if generated is None:
                    return
            else:
                prompts = self.parts.source.next_batch()
                generated = generate_round(self.parts, prompts, 0, self.seed_of(step))
            with self._lock:
                self._in_hand = len(generated.rollouts)  # counted by close() until queued
            while not self._stopping:  # the scorer may be busy, or gone after an error
                try:
                    self._to_score.put((step, version, generated), timeout=0.1)
                    with self._lock:
                        self._in_hand = 0
                    break
                except queue.Full:
                    continue

    def _release_before(self, version: int) -> None:
        """Drops the published weights older than ``version`` (the caller holds the lock):
        never loaded again, as versions only grow."""
        for old in [v for v in self._published if v < version]:
            del self._published[old]

    def _load(self, version: int, weights) -> None:
        if version != self.engine.weight_version:
            # kept here until a newer version loads: the engine may read them again
            self.engine.load_weights(version, WeightStream(weights, partial(iter, weights)))

    def _partial_batch(self, step: int) -> Generated | None:
        """Step ``step``'s batch from the pool: chunks until ``batch_size`` groups are
        finished, the newest published weights loaded between chunks; None when stopping."""
        pool, started, ended = self.pool, time.perf_counter(), 0
        while True:
            with self._lock:
                if self._stopping:
                    return None
                newest = self._trained
                pool.add(self.parts.source.next_batch(pool.room(step, newest)))
                weights = self._published.get(newest)
                self._release_before(newest)
            self._load(newest, weights)
            pool.chunk(self.seed_of(step))
            if pool.ready() >= pool.batch_size:
                ended = pool.end_stale(step)
                break
        with self._lock:
            groups = pool.take()
            self._emitted[step] = [group.prompt for group in groups]
        rollouts = pool.rollouts(groups, self.engine.weight_version)
        ages: Counter = Counter()
        for rollout in rollouts:
            ages.update(step - 1 - v for v in rollout.token_versions())
        metrics = {
            "partial/carried_samples": pool.in_flight(),
            "partial/ended_stale": ended,
            "partial/multi_version_samples": sum(len(r.version_spans or ()) > 1 for r in rollouts),
            **{f"partial/tokens_age{age}": count for age, count in sorted(ages.items())},
        }
        prompts = [group.prompt for group in groups]
        requests = [
            GenerationRequest(p.id, self.parts.prompt_ids[p.id], i) for i, p in enumerate(prompts)
        ]
        seconds = time.perf_counter() - started
        engine_metrics, events = self.engine.take_report()  # speculation, timeouts
        return Generated(
            prompts, requests, rollouts, seconds, report=(engine_metrics | metrics, events)
        )

    def _score(self, parts: Components) -> None:
        while (item := self._to_score.get()) is not STOP:
            step, version, generated = item
            if self.pool is not None and generated.rollouts:  # its oldest token's version
                version = min(r.weight_version for r in generated.rollouts)
            out = Collected()
            score_round(self.config, parts, generated, out)
            with self._lock:
                cursor = self._cursors[step]
                self._ready[step] = Produced(step, version, cursor, out)
                self._lock.notify_all()
