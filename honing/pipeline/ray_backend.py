"""The Ray backend (``pipeline.backend=ray``): the trainer, rollout workers and reward workers
as Ray actors, on a local Ray instance or an existing cluster. The only module importing ray.

The loop is the one every schedule runs (``loop.TrainLoop``, ``producer.RolloutProducer``);
Ray changes where its parts live, not what they do:

- ``train_on_ray`` (the ``honing train`` process) joins or starts Ray, starts the run's
  control actor and the **trainer actor** (``pipeline.trainer_cpus`` / ``trainer_gpus``), and
  waits for it; errors raised in the actor (a bad config, an alert's stop) come back as they
  were raised, so exit statuses are the same as without Ray.
- In the trainer actor the run is built as usual, then ``attach`` swaps in the two pools: the
  training engine becomes ``RayRolloutEngine`` over ``pipeline.rollout_workers`` **rollout
  workers** (each a ``TransformersEngine`` on its own copy of the policy), and the scorer
  becomes ``RayScorer`` over ``pipeline.reward_workers`` **reward workers** (each the run's
  own scorer, ``build_scorer``). Validation stays in the trainer, on the policy itself.
- Under ``schedule.mode=one_step|async`` the producer's queue sits in the trainer actor: its
  generation thread feeds the rollout workers while its scoring threads feed the reward
  workers and the trainer updates.

Rollout work is split into tasks of ``pipeline.rollout_chunk`` prompts, each seeded by its
place in the batch, and handed to whichever worker is free: a step's samples are the same for
any number of workers, and the same when a worker dies and its task runs elsewhere.

Elastic: before each batch (and as tasks finish) the engine matches the number of workers to
the run's control actor, which ``honing scale RUN_DIR --rollout-workers N`` (or ``scale``)
sets while training runs: new workers join once loaded (with the newest weights), surplus
ones leave when idle. A worker that dies is replaced; its task runs on another worker and its
samples are counted in ``samples/regenerated``. Events: ``rollout_worker_replaced``,
``reward_worker_replaced``, ``rollout_workers_scaled``. Metrics: ``ray/rollout_workers``,
``ray/reward_workers`` (live workers when the step's batch was taken).

Placement: ``pipeline.placement=spread`` spreads the workers over the cluster's nodes (Ray's
SPREAD strategy), ``pack`` lets Ray pack them. Every node must see ``model.path`` (a shared
filesystem, or the same path on each node) and have honing installed.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from honing.config import Config, PipelineConfig
from honing.errors import ConfigError, UserError
from honing.rollout.base import GenerationRequest, SamplingParams, chunked
from honing.rollout.mtp import MTP_PREFIX
from honing.rollout.speculative import merge_metrics
from honing.types import Rollout

NAMESPACE = "honing"  # the Ray namespace of every actor a run starts
MAX_REPLACEMENTS = 8  # workers of a pool that may die in a row before the run stops
DEAD = (RayActorError, getattr(ray.exceptions, "ActorUnavailableError", RayActorError))


class WorkersUnavailable(UserError):
    """No worker of a pool could be started or placed."""


# -- the honing train process ------------------------------------------------------------


def connect(settings: PipelineConfig) -> bool:
    """Joins ``pipeline.ray_address`` (or starts a local Ray instance when it is empty);
    returns whether this call started Ray (and so must shut it down). Already connected
    (a script or test that called ``ray.init``): that connection is used."""
    if ray.is_initialized():
        return False
    address = settings.ray_address or None
    kwargs = {"namespace": NAMESPACE, "log_to_driver": True}
    if address is None:  # a local instance with room for every actor the run asks for
        wanted = (
            settings.trainer_cpus
            + settings.rollout_workers * settings.rollout_cpus
            + settings.reward_workers * settings.reward_cpus
        )
        kwargs |= {"num_cpus": max(os.cpu_count() or 1, int(wanted + 0.999) + 1)}
        kwargs |= {"include_dashboard": False}
    try:
        ray.init(address=address, **kwargs)
    except ConnectionError as err:
        raise ConfigError(
            f"pipeline.ray_address={settings.ray_address!r}: no Ray cluster answered ({err}); "
            "start one with `ray start --head` or leave the key empty for a local instance"
        ) from None
    return True


def run_id(run_dir: Path) -> str:
    """A name for the run's actors: the run directory's name and a hash of its full path."""
    path = str(Path(run_dir).resolve())
    return f"{Path(path).name}-{hashlib.sha1(path.encode()).hexdigest()[:8]}"


def check_supported(config: Config) -> None:
    if config.rollout.engine != "transformers":
        raise ConfigError(
            "pipeline.backend=ray runs honing's own engine in its rollout workers; "
            f"rollout.engine={config.rollout.engine} is for remote servers (use backend=local)"
        )


def train_on_ray(config: Config, run_dir: Path, resume: str) -> dict:
    """Runs ``run.train_here`` in the trainer actor; returns its summary."""
    check_supported(config)
    settings = config.pipeline
    started = connect(settings)
    rid = run_id(run_dir)
    control = Control.options(name=f"{rid}/control", namespace=NAMESPACE, num_cpus=0).remote(
        settings.rollout_workers, settings.reward_workers
    )
    trainer = TrainerActor.options(
        num_cpus=settings.trainer_cpus,
        num_gpus=settings.trainer_gpus,
        name=f"{rid}/trainer",
        namespace=NAMESPACE,
    ).remote(rid, control)
    try:
        wait_ready(
            trainer,
            "the trainer actor",
            settings.trainer_cpus,
            settings.trainer_gpus,
            settings.actor_start_timeout_s,
        )
        try:
            return ray.get(trainer.train.remote(config, str(run_dir), resume))
        except RayTaskError as err:
            raise _cause(err) from None
    finally:
        ray.kill(trainer)  # its workers go with it
        ray.kill(control)
        if started:
            ray.shutdown()


def scale(
    run_dir: str | Path,
    rollout_workers: int | None = None,
    reward_workers: int | None = None,
    address: str = "auto",
) -> dict:
    """Sets the worker targets of the run training into ``run_dir`` on the Ray cluster at
    ``address``; returns the new targets."""
    started = False
    if not ray.is_initialized():
        try:
            ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
        except ConnectionError as err:
            raise ConfigError(f"--address {address}: no Ray cluster answered ({err})") from None
        started = True
    try:
        try:
            control = ray.get_actor(f"{run_id(Path(run_dir))}/control", namespace=NAMESPACE)
        except ValueError:
            raise ConfigError(
                f"{run_dir}: no run with pipeline.backend=ray is training into it on this cluster"
            ) from None
        try:
            return ray.get(control.set.remote(rollout_workers, reward_workers))
        except RayTaskError as err:
            raise ConfigError(str(_cause(err))) from None
    finally:
        if started:
            ray.shutdown()


def wait_ready(actor, what: str, cpus: float, gpus: float, timeout_s: float) -> None:
    try:
        ray.get(actor.ready.remote(), timeout=timeout_s)
    except GetTimeoutError:
        raise WorkersUnavailable(
            f"{what} was not placed within pipeline.actor_start_timeout_s={timeout_s:g}: it "
            f"asks for {cpus:g} CPUs and {gpus:g} GPUs; the cluster has "
            f"{ray.available_resources()} free. Lower the pipeline.*_cpus / *_gpus keys or add "
            "nodes"
        ) from None
    except RayTaskError as err:
        raise _cause(err) from None


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return (text.splitlines()[0] if text else type(error).__name__)[:300]


def _cause(err: RayTaskError) -> BaseException:
    """The exception an actor raised, as it was raised (a ``UserError`` stays one)."""
    cause = getattr(err, "cause", None)
    return cause if isinstance(cause, BaseException) else err


@ray.remote(num_cpus=0)
class Control:
    """The run's worker targets, which ``scale`` changes while training runs."""

    def __init__(self, rollout_workers: int, reward_workers: int):
        self.targets = {"rollout_workers": rollout_workers, "reward_workers": reward_workers}

    def set(self, rollout_workers: int | None, reward_workers: int | None) -> dict:
        for key, value in (
            ("rollout_workers", rollout_workers),
            ("reward_workers", reward_workers),
        ):
            if value is not None:
                if value < (1 if key == "rollout_workers" else 0):
                    raise ValueError(f"{key}: expected >= {1 if key == 'rollout_workers' else 0}")
                self.targets[key] = int(value)
        return dict(self.targets)

    def get(self) -> dict:
        return dict(self.targets)


@ray.remote
class TrainerActor:
    """Runs the whole run (``run.train_here``); the pools it starts are its children."""

    def __init__(self, rid: str, control):
        # Ray ships this class by value: reach the imported module's session, not a copy.
        from honing.pipeline import ray_backend

        ray_backend._SESSION.update(run_id=rid, control=control)

    def ready(self) -> bool:
        return True

    def train(self, config: Config, run_dir: str, resume: str) -> dict:
        from honing.pipeline.run import train_here

        return train_here(config, Path(run_dir), resume)


# Set in the trainer actor: the run's id and control actor, for ``attach``.
_SESSION: dict = {}


# -- in the trainer actor: the pools -----------------------------------------------------


def attach(config: Config, parts, model_dir: Path):
    """Swaps ``parts``' training engine and scorer for the Ray pools (see the module)."""
    from honing.pipeline.components import engine_weights

    check_supported(config)
    if not _SESSION:  # built outside a trainer actor (a script): a session of its own
        connect(config.pipeline)
        rid = f"adhoc-{time.time_ns()}"
        _SESSION.update(
            run_id=rid,
            control=Control.options(name=f"{rid}/control", namespace=NAMESPACE).remote(
                config.pipeline.rollout_workers, config.pipeline.reward_workers
            ),
        )
    report = Report()
    engine = RayRolloutEngine(config, model_dir, _SESSION["control"], _SESSION["run_id"], report)
    engine.load_weights(0, engine_weights(parts.policy, engine, parts.mtp))
    scorer = parts.scorer
    if config.pipeline.reward_workers:
        rewards = RewardPool(config, _SESSION["control"], _SESSION["run_id"], report)
        scorer = RayScorer(rewards, parts.scorer)
    return replace(
        parts,
        engine=engine,
        scorer=scorer,
        make_scorer=getattr(scorer, "sibling", parts.make_scorer),
    )


class Report:
    """Events and gauges of the pools, for the loop to log with its step."""

    def __init__(self):
        self.lock = threading.Lock()
        self.events: list[tuple[str, dict]] = []
        self.gauges: dict[str, float] = {}  # worker counts: reported every step
        self.once: dict[str, float] = {}  # the workers' engine reports: until drained

    def event(self, kind: str, **fields) -> None:
        with self.lock:
            self.events.append((kind, fields))

    def drain(self) -> tuple[dict[str, float], list[tuple[str, dict]]]:
        """Gauges as they are now, plus the per-call metrics and events since the last
        drain."""
        with self.lock:
            events, self.events = self.events, []
            once, self.once = self.once, {}
            return dict(self.gauges) | once, events


@dataclass
class _Worker:
    name: str
    handle: object
    ready: object  # the ObjectRef of its ready() call, until it answered
    version: int = -1  # the weight version it was sent last
    busy: bool = False


class _Pool:
    """Actors of one kind, kept at the control actor's target: started, replaced, retired."""

    kind = ""  # rollout | reward

    def __init__(self, config: Config, control, rid: str, report: Report, actor, resources):
        """``actor``: the Ray actor class, started with ``config`` and ``resources``."""
        self.control, self.rid, self.report = control, rid, report
        self.timeout_s = config.pipeline.actor_start_timeout_s
        self.config, self.actor = config, actor
        self.options = dict(resources)
        if config.pipeline.placement == "spread":
            self.options["scheduling_strategy"] = "SPREAD"
        self.workers: list[_Worker] = []
        self.lock = threading.RLock()
        self._count = 0
        self._replaced_in_a_row = 0  # replacements since a task last succeeded

    def _new_actor(self, name: str):
        return self.actor.options(name=name, namespace=NAMESPACE, **self.options).remote(
            *self._actor_args()
        )

    def _actor_args(self) -> tuple:
        return (self.config,)

    def _target(self) -> int:
        return ray.get(self.control.get.remote())[f"{self.kind}_workers"]

    def reconcile(self, quiet: bool = False) -> None:
        """Starts or retires workers to meet the target; retires only idle ones. ``quiet``:
        no event (the pool's first start)."""
        with self.lock:
            target = self._target()
            before = len(self.workers)
            while len(self.workers) < target:
                self._start()
            surplus = len(self.workers) - target
            for worker in [w for w in reversed(self.workers) if not w.busy][: max(surplus, 0)]:
                self.workers.remove(worker)
                ray.kill(worker.handle)
            if len(self.workers) != before and not quiet:
                self.report.event(
                    f"{self.kind}_workers_scaled", before=before, after=len(self.workers)
                )
            self.report.gauges[f"ray/{self.kind}_workers"] = float(len(self.workers))

    def _start(self) -> _Worker:
        self._count += 1
        name = f"{self.rid}/{self.kind}-{self._count}"
        handle = self._new_actor(name)
        worker = _Worker(name, handle, handle.ready.remote())
        self.workers.append(worker)
        return worker

    def replace_dead(self, worker: _Worker, error: BaseException) -> None:
        """Replaces a worker that died. One that failed while loading raises its error (a
        replacement would fail the same way), as do ``MAX_REPLACEMENTS`` deaths in a row."""
        if getattr(error, "actor_init_failed", False):
            raise WorkersUnavailable(
                f"a {self.kind} worker failed while starting: {_first_line(error)}"
            ) from None
        with self.lock:
            if worker in self.workers:
                self.workers.remove(worker)
                ray.kill(worker.handle)  # a merely unreachable one would keep its resources
                self._replaced_in_a_row += 1
                if self._replaced_in_a_row > MAX_REPLACEMENTS:
                    raise WorkersUnavailable(
                        f"{self._replaced_in_a_row} {self.kind} workers died in a row without "
                        f"finishing a task; the last: {_first_line(error)}"
                    )
                new = self._start()
                self.report.event(
                    f"{self.kind}_worker_replaced",
                    dead=worker.name,
                    new=new.name,
                    error=_first_line(error),
                )

    def claim(self, count: int) -> list[_Worker]:
        """Up to ``count`` idle workers that have finished starting, marked busy. When no
        worker is ready at all and none is busy, waits for one to start (up to
        ``pipeline.actor_start_timeout_s``)."""
        while True:
            with self.lock:
                self._poll_ready(0)
                idle = [w for w in self.workers if w.ready is None and not w.busy][:count]
                for worker in idle:
                    worker.busy = True
                if idle or any(w.busy for w in self.workers):
                    return idle
                starting = [w.ready for w in self.workers if w.ready is not None]
            if not starting:
                raise WorkersUnavailable(f"no {self.kind} worker is left")
            done, _ = ray.wait(starting, num_returns=1, timeout=self.timeout_s)
            if not done:
                raise WorkersUnavailable(
                    f"no {self.kind} worker started within pipeline.actor_start_timeout_s="
                    f"{self.timeout_s:g}; the cluster has {ray.available_resources()} free "
                    f"(lower pipeline.{self.kind}_cpus / _gpus or add nodes)"
                )

    def _poll_ready(self, timeout: float) -> None:
        for worker in list(self.workers):
            if worker.ready is None:
                continue
            done, _ = ray.wait([worker.ready], timeout=timeout)
            if not done:
                continue
            try:
                ray.get(worker.ready)
                worker.ready = None
            except DEAD as err:
                self.replace_dead(worker, err)
            except RayTaskError as err:  # it could not even load: that is the user's to fix
                raise _cause(err) from None

    def close(self) -> None:
        with self.lock:
            for worker in self.workers:
                ray.kill(worker.handle)
            self.workers = []

    def run_tasks(self, tasks: list, submit, on_lost=None) -> dict:
        """Runs ``submit(worker, task) -> ObjectRef`` for each task on free workers; a task
        whose worker died runs again on another (``on_lost(task)`` counts it). Returns the
        results by task index."""
        pending = deque(enumerate(tasks))
        results: dict[int, object] = {}
        running: dict = {}  # ObjectRef -> (worker, (index, task))
        try:
            while pending or running:
                self.reconcile()
                if pending:
                    for worker in self.claim(len(pending)):
                        item = pending.popleft()
                        running[submit(worker, item[1])] = (worker, item)
                if not running:  # every worker is busy with another thread's tasks
                    time.sleep(0.01)
                    continue
                done, _ = ray.wait(list(running), num_returns=1, timeout=1.0)
                for ref in done:
                    worker, item = running.pop(ref)
                    try:  # the outcome first: a dead worker must not be claimed meanwhile
                        results[item[0]] = ray.get(ref)
                    except DEAD as err:
                        self.replace_dead(worker, err)
                        pending.appendleft(item)
                        if on_lost is not None:
                            on_lost(item[1])
                        continue
                    except RayTaskError as err:
                        self._release(worker)
                        raise _cause(err) from None
                    with self.lock:
                        self._replaced_in_a_row = 0
                    self._release(worker)
        finally:  # on an error, the workers still running a task of this call are freed
            for worker, _ in running.values():
                self._release(worker)
        return results

    def _release(self, worker: _Worker) -> None:
        with self.lock:
            worker.busy = False


@ray.remote
class RolloutWorker:
    """A ``TransformersEngine`` on its own copy of the policy."""

    def __init__(self, config: Config, model_dir: str):
        import torch

        from honing.models.loading import load_tokenizer, resolve_device
        from honing.pipeline.components import frozen_model, local_engine

        threads = int(ray.get_runtime_context().get_assigned_resources().get("CPU", 1) or 1)
        torch.set_num_threads(max(threads, 1))
        device = resolve_device(config.model.device)
        tokenizer = load_tokenizer(model_dir, trust_remote_code=config.model.trust_remote_code)
        model = frozen_model(Path(model_dir), tokenizer, config, device)
        self.engine = local_engine(config, model, tokenizer, device)
        self.engine.shares_policy = False

    def ready(self) -> bool:
        return True

    def node(self) -> str:
        """The id of the node it runs on."""
        return ray.get_runtime_context().get_node_id()

    def generate(self, version: int, weights, requests, params):
        """The rollouts, and the engine's report (speculation, timeouts) of this call."""
        if weights is not None:
            heads = {k: v for k, v in weights.items() if k.startswith(MTP_PREFIX)}
            if heads:  # rollout.speculative=mtp: the heads the trainer trains
                weights = {k: v for k, v in weights.items() if k not in heads}
                heads = {k.removeprefix(MTP_PREFIX): v for k, v in heads.items()}
                self.engine.speculation.draft_model.load_state_dict(heads)
            self.engine.load_weights(version, weights)
        rollouts = self.engine.generate(requests, params)
        return rollouts, self.engine.take_report()


class RayRolloutEngine(_Pool):
    """A ``RolloutEngine`` over rollout-worker actors (see the module)."""

    kind = "rollout"
    shares_policy = False

    def __init__(self, config: Config, model_dir: Path, control, rid: str, report: Report):
        settings = config.pipeline
        resources = {"num_cpus": settings.rollout_cpus, "num_gpus": settings.rollout_gpus}
        super().__init__(config, control, rid, report, RolloutWorker, resources)
        self.model_dir, self.chunk = str(model_dir), settings.rollout_chunk
        self.weight_version = 0
        self.regenerated = 0
        self._latest = None  # (version, ObjectRef of the weights)
        self.reconcile(quiet=True)

    def _actor_args(self) -> tuple:
        return (self.config, self.model_dir)

    def take_report(self) -> tuple[dict[str, float], list[tuple[str, dict]]]:
        """The pools' gauges now and their events since the last call."""
        return self.report.drain()

    def detached_copy(self) -> RayRolloutEngine:
        return self  # the workers hold their own copies of the weights

    def load_weights(self, version: int, state_dict: dict | None = None) -> None:
        if state_dict is not None:
            cpu = {k: v.detach().to("cpu", copy=True) for k, v in state_dict.items()}
            self._latest = (version, ray.put(cpu))
        self.weight_version = version

    def generate(self, requests: list[GenerationRequest], params: SamplingParams) -> list[Rollout]:
        tasks = chunked(requests, params, self.chunk)

        def submit(worker: _Worker, task):
            version, ref = self._latest if self._latest else (self.weight_version, None)
            weights = ref if worker.version != version else None  # sent once per worker
            worker.version = version
            return worker.handle.generate.remote(version, weights, task[0], task[1])

        def lost(task):
            with self.lock:
                self.regenerated += len(task[0]) * params.n

        results = self.run_tasks(tasks, submit, lost)
        self._merge_reports([results[index][1] for index in sorted(results)])
        return [rollout for index in sorted(results) for rollout in results[index][0]]

    def _merge_reports(self, reports) -> None:
        """The workers' engine reports as one (counts summed, acceptance recomputed)."""
        for _, events in reports:
            for kind, fields in events:
                self.report.event(kind, **fields)
        merged = merge_metrics([metrics for metrics, _ in reports])
        with self.report.lock:
            self.report.once = merge_metrics([self.report.once, merged])


@ray.remote
class RewardWorker:
    """The run's scorer, in its own process."""

    def __init__(self, config: Config):
        from honing.pipeline.components import build_scorer

        self.scorer = build_scorer(config)

    def ready(self) -> bool:
        return True

    def score(self, prompts_by_id, rollouts, rendered, on_error=None):
        scores = self.scorer.score(prompts_by_id, rollouts, rendered, on_error)
        return scores, self.scorer.last_latencies_ms, self.scorer.last_metrics


class RewardPool(_Pool):
    kind = "reward"

    def __init__(self, config: Config, control, rid: str, report: Report):
        resources = {"num_cpus": config.pipeline.reward_cpus}
        super().__init__(config, control, rid, report, RewardWorker, resources)
        self.reconcile(quiet=True)

    def _target(self) -> int:
        return max(super()._target(), 1)  # set to 0 while running: keep one


class RayScorer:
    """A ``Scorer`` whose work runs on the reward workers: each call's rollouts are split
    into one shard per live worker; a shard whose worker died is scored again elsewhere."""

    def __init__(self, pool: RewardPool, local, owner: bool = True):
        self.pool, self.local, self.owner = pool, local, owner
        self.reward_fn = local.reward_fn  # load-time checks read it
        self.on_error, self.failure = local.on_error, local.failure  # validation reads them
        self.last_latencies_ms: list[float] = []
        self.last_metrics: dict[str, float] = {}

    def sibling(self) -> RayScorer:
        """Another view on the same workers (each scoring thread records its own calls)."""
        return RayScorer(self.pool, self.local, owner=False)

    def score(self, prompts_by_id, rollouts, rendered_prompts=None, on_error=None):
        rendered_prompts = rendered_prompts or {}
        count = max(len(self.pool.workers), 1)
        size = -(-len(rollouts) // count) or 1
        shards = [rollouts[i : i + size] for i in range(0, len(rollouts), size)]

        def submit(worker: _Worker, shard):
            ids = {r.prompt_id for r in shard}
            return worker.handle.score.remote(
                {i: prompts_by_id[i] for i in ids},
                shard,
                {i: rendered_prompts[i] for i in ids if i in rendered_prompts},
                on_error,
            )

        results = self.pool.run_tasks(shards, submit)
        scores, self.last_latencies_ms, self.last_metrics = [], [], {}
        for index in sorted(results):
            part, latencies, metrics = results[index]
            scores += part
            self.last_latencies_ms += latencies
            for key, value in metrics.items():
                self.last_metrics[key] = self.last_metrics.get(key, 0.0) + value
        return scores

    def close(self) -> None:
        if self.owner:
            self.pool.close()
            self.local.close()
