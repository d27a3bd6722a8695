"""The Ray backend's pools: actors of one kind (rollout or reward workers) kept at the run's
target (``Control``, which ``honing scale`` changes while training runs), started, replaced
when they die, retired when surplus, and the tasks of a call run on whichever is free.

A worker that dies is replaced (event ``{kind}_worker_replaced``). One whose node is lost (a
spot node preempted: its raylet gone) takes the pool's other workers of that node with it:
they are replaced together, in one event ``{kind}_node_lost`` that names the node, the
workers lost, their replacements and the tasks that run again. Ray's GCS learns of a
vanished node only when its health checks fail (``RAY_health_check_period_ms`` ×
``RAY_health_check_failure_threshold``, 3 s × 5 by default), so a node counts as lost when the
GCS says so or when its raylet refuses a connection; the replacements start once the GCS has
marked it dead (at most ``LOST_NODE_WAIT_S``), as until then Ray would place them there.
"""

from __future__ import annotations

import socket
import threading
import time
from collections import deque
from dataclasses import dataclass

import ray
from ray.exceptions import RayActorError, RayTaskError

from honing.config import Config
from honing.errors import UserError

NAMESPACE = "honing"  # the Ray namespace of every actor a run starts
MAX_REPLACEMENTS = 8  # workers of a pool that may die in a row before the run stops
LOST_NODE_WAIT_S = 60.0  # the longest wait for the GCS to mark a lost node dead
DEAD = (RayActorError, getattr(ray.exceptions, "ActorUnavailableError", RayActorError))


class WorkersUnavailable(UserError):
    """No worker of a pool could be started or placed."""


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return (text.splitlines()[0] if text else type(error).__name__)[:300]


def _cause(err: RayTaskError) -> BaseException:
    """The exception an actor raised, as it was raised (a ``UserError`` stays one)."""
    cause = getattr(err, "cause", None)
    return cause if isinstance(cause, BaseException) else err


# Ray's resource of the head node: an actor that asks for a sliver of it runs there.
HEAD_NODE = {"node:__internal_head__": 0.001}


@ray.remote(num_cpus=0, resources=HEAD_NODE)
class Control:
    """The run's worker targets, which ``scale`` changes while training runs. On the head
    node, which a run cannot lose and go on (Ray's GCS is there): elsewhere (an actor that
    asks for no CPU goes anywhere) a lost spot node would take it along."""

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
    node: str = ""  # the id of the node it runs on, once it has started


def _node_of(handle) -> str:
    """The id of the node Ray placed an actor on ("" before it is placed). From the GCS's
    actor table (``ray.util.state`` would need the dashboard, which a run's instance lacks)."""
    info = ray._private.state.actors(handle._actor_id.hex())
    return (info.get("Address") or {}).get("NodeID", "") if info else ""


def _node_lost(node_id: str) -> bool:
    """Whether the node is gone: the GCS says so, or its raylet refuses a connection (or
    leaves it unanswered for 2 s), which the GCS notices only after its health checks."""
    for node in ray.nodes():
        if node["NodeID"] == node_id:
            if not node["Alive"]:
                return True
            address = (node["NodeManagerAddress"], node["NodeManagerPort"])
            try:
                with socket.create_connection(address, timeout=2.0):
                    return False
            except OSError:
                return True
    return True  # a node the GCS no longer lists


def _wait_marked_dead(node_id: str, timeout_s: float) -> None:
    """Until the GCS no longer counts the node alive (or ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes()):
            return
        time.sleep(0.2)


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
        """Replaces a worker that died, with the pool's other workers of its node when the
        node is lost (the module's docstring). One that failed while loading raises its error
        (a replacement would fail the same way), as do ``MAX_REPLACEMENTS`` deaths (or lost
        nodes) in a row. The tasks of the workers removed fail in their callers' ``run_tasks``,
        which runs them again."""
        if getattr(error, "actor_init_failed", False):
            raise WorkersUnavailable(
                f"a {self.kind} worker failed while starting: {_first_line(error)}"
            ) from None
        with self.lock:
            if worker not in self.workers:
                return  # replaced already, with its node
            node = worker.node or _node_of(worker.handle)
            lost = bool(node) and _node_lost(node)
            gone = [worker]
            if lost:  # every worker of the node (``worker`` among them)
                gone = [w for w in self.workers if (w.node or _node_of(w.handle)) == node]
            for each in gone:
                self.workers.remove(each)
                ray.kill(each.handle)  # a merely unreachable one would keep its resources
            self._replaced_in_a_row += 1
            if self._replaced_in_a_row > MAX_REPLACEMENTS:
                raise WorkersUnavailable(
                    f"{self._replaced_in_a_row} {self.kind} workers died in a row without "
                    f"finishing a task; the last: {_first_line(error)}"
                )
            if lost:
                _wait_marked_dead(node, LOST_NODE_WAIT_S)
            new = [self._start().name for _ in gone]
            if lost:
                self.report.event(
                    f"{self.kind}_node_lost",
                    node=node,
                    workers=[each.name for each in gone],
                    new=new,
                    tasks=sum(each.busy for each in gone),  # running there: they run again
                    error=_first_line(error),
                )
            else:
                self.report.event(
                    f"{self.kind}_worker_replaced",
                    dead=worker.name,
                    new=new[0],
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
                worker.node = _node_of(worker.handle)
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
