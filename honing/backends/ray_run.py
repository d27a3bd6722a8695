"""The Ray backend (``pipeline.backend=ray``): the trainer, rollout workers and reward workers
as Ray actors, on a local Ray instance or an existing cluster. With ``ray_pools`` and
``ray_workers``, the only modules importing ray.

The loop is the one every schedule runs (``loop.TrainLoop``, ``producer.RolloutProducer``);
Ray changes where its parts live, not what they do:

- ``train_on_ray`` (the ``honing train`` process) joins or starts Ray, starts the run's
  control actor and the **trainer actors** (``pipeline.trainer_workers``, each
  ``pipeline.trainer_cpus`` / ``trainer_gpus``, one placement group), and waits for them;
  errors raised in an actor (a bad config, an alert's stop) come back as they were raised, so
  exit statuses are the same as without Ray, and an actor that dies is ``TrainerLost`` (a
  crash: ``--max-restarts`` resumes the run).
- Several trainer actors are torchrun's ranks, placed by Ray: each gets torchrun's
  environment (rank, world size, rank 0's address) and runs ``torchrun.train_ranks``, rank 0
  leading and the others following (``trainer.strategy``, ``trainer.sequence_parallel`` as
  under torchrun). The followers' rollout engine is ``_OnWorkers``, which only joins the
  gathers of each version that rank 0 sends the rollout workers.
- In rank 0's trainer actor the run is built as usual, then ``attach`` swaps in the two
  pools: the training engine becomes ``RayRolloutEngine`` over ``pipeline.rollout_workers``
  **rollout workers** (each a ``TransformersEngine`` on its own copy of the policy, or vLLM
  in the actor under ``rollout.engine=vllm``; under ``rollout.engine=openai`` the actor
  samples from the servers itself and no rollout worker starts), and the scorer becomes
  ``RayScorer`` over ``pipeline.reward_workers`` **reward workers** (each the run's own
  scorer, ``build_scorer``). Validation stays in the trainer, on the policy itself.
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
samples are counted in ``samples/regenerated``; the workers of a lost node go together
(``ray_pools``). With ``pipeline.autoscale_max`` the engine sets the target itself from where
each step waited (``autoscale``). Events: ``rollout_worker_replaced``, ``rollout_node_lost``,
``reward_worker_replaced``, ``rollout_workers_scaled``, ``rollout_workers_autoscaled``.
Metrics: ``ray/rollout_workers``, ``ray/reward_workers`` (live workers when the step's batch
was taken).

Placement: ``pipeline.placement=spread`` spreads the workers over the cluster's nodes (Ray's
SPREAD strategy), ``pack`` lets Ray pack them. Every node must see ``model.path`` (a shared
filesystem, or the same path on each node) and have honing installed.

The local instance a run starts when ``pipeline.ray_address`` is empty is bound to loopback
(``start_local``): nothing of it can be reached from the network. A cluster of several
machines is started with ``ray start`` and joined at its address.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import time
from dataclasses import replace
from pathlib import Path

import ray
import ray._private.ray_constants as ray_constants
from ray._common.network_utils import is_localhost, parse_address
from ray._private.authentication.authentication_token_setup import (
    maybe_enable_token_auth_if_token_available,
)
from ray._private.services import canonicalize_bootstrap_address_or_die
from ray.exceptions import GetTimeoutError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from honing.backends.ray_pools import (
    DEAD,
    NAMESPACE,
    Control,
    Report,
    WorkersUnavailable,
    _cause,
    _first_line,
)
from honing.backends.ray_workers import (
    RayRolloutEngine,
    RayScorer,
    RewardPool,
    turns_on_workers,
)
from honing.backends.torchrun import train_ranks
from honing.config import Config, PipelineConfig
from honing.errors import ConfigError, ProcessLost
from honing.pipeline.components import Components, build_components
from honing.pipeline.run import stderr_log, train_here
from honing.pipeline.weight_sync import rollout_weights
from honing.rollout.base import Holding, RolloutEngine
from honing.rollout.tools.turns import with_tools


def connect(settings: PipelineConfig) -> bool:
    """Joins ``pipeline.ray_address`` (or starts a local Ray instance when it is empty);
    returns whether this call started Ray (and so must shut it down). Already connected
    (a script or test that called ``ray.init``): that connection is used."""
    if ray.is_initialized():
        return False
    if not settings.ray_address:  # a local instance with room for every actor the run asks for
        wanted = (
            settings.trainer_workers * settings.trainer_cpus
            + settings.rollout_workers * settings.rollout_cpus
            + settings.reward_workers * settings.reward_cpus
        )
        start_local(max(os.cpu_count() or 1, int(wanted + 0.999) + 1))
        return True
    try:
        join(settings.ray_address, log_to_driver=True)
    except ConnectionError as err:
        raise ConfigError(
            f"pipeline.ray_address={settings.ray_address!r}: no Ray cluster could be joined "
            f"there ({err}); start one with `ray start --head` or leave the key empty for a "
            "local instance"
        ) from None
    return True


# Ray takes a node's address to be 127.0.0.1 where clusters of several machines are off (its
# default on macOS and Windows), read from this variable when ray is imported.
_ONE_MACHINE = ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR


@contextlib.contextmanager
def on_loopback():
    """Ray as it runs on one machine: a node started (or a driver joining) inside ``with`` has
    127.0.0.1 for its address, so an instance started there listens on loopback alone (its
    GCS, raylet, object manager and workers). Outside it Ray takes the machine's network
    address, for 127.0.0.1 too, and binds its servers there. Ray reads this from a private
    constant set from ``_ONE_MACHINE`` at import: both are set for the ``with`` (the variable
    for the processes it starts). ``tests/pipeline/test_ray_backend.py`` reads the sockets
    the instance listens on, should Ray change this."""
    before = ray_constants.ENABLE_RAY_CLUSTER, os.environ.get(_ONE_MACHINE)
    ray_constants.ENABLE_RAY_CLUSTER = False
    os.environ[_ONE_MACHINE] = "0"
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before[0]
        if before[1] is None:
            os.environ.pop(_ONE_MACHINE, None)
        else:
            os.environ[_ONE_MACHINE] = before[1]


def start_local(num_cpus: int, log_to_driver: bool = True) -> None:
    """Starts a Ray instance of this machine alone, bound to loopback (``on_loopback``), with
    ``num_cpus`` logical CPUs and no dashboard, and connects to it."""
    with on_loopback():
        ray.init(
            namespace=NAMESPACE,
            num_cpus=num_cpus,
            include_dashboard=False,
            log_to_driver=log_to_driver,
        )


def join(address: str, log_to_driver: bool) -> None:
    """Connects to the Ray cluster at ``address`` (``auto``: the one running here), at that
    address: a loopback one (127.0.0.1:P, localhost:P) is dialled on loopback
    (``on_loopback``), where Ray would dial the machine's network address instead, at which a
    node bound to loopback does not listen. A cluster of this machine (a loopback address, or
    ``auto``) is sent this machine's Ray token (``~/.ray/auth_token``, ``RAY_AUTH_TOKEN``)
    when there is one, as Ray does for ``auto`` alone: ``ray start --head`` asks for it
    whenever the file exists. Any other cluster is joined as Ray joins it (one that asks for
    a token wants ``RAY_AUTH_MODE=token`` here). Raises ``ConnectionError`` when none
    answers, or when it refuses this process's token (or the lack of one)."""
    with on_loopback():
        found = canonicalize_bootstrap_address_or_die(address)
    loopback = is_localhost((parse_address(found) or ("",))[0])
    if loopback or address == "auto":
        maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    try:
        with on_loopback() if loopback else contextlib.nullcontext():
            ray.init(address=found, namespace=NAMESPACE, log_to_driver=log_to_driver)
    except ConnectionError as err:
        if "InvalidAuthToken" not in str(err.__cause__):
            raise
        raise ConnectionError(
            f"{err}: it asks for a token this process did not send (RAY_AUTH_MODE=token, with "
            "the cluster's token in ~/.ray/auth_token, RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH)"
        ) from err


def run_id(run_dir: Path) -> str:
    """A name for the run's actors: the run directory's name and a hash of its full path."""
    path = str(Path(run_dir).resolve())
    return f"{Path(path).name}-{hashlib.sha1(path.encode()).hexdigest()[:8]}"


def train_on_ray(config: Config, run_dir: Path, resume: str) -> dict:
    """Runs the run in ``pipeline.trainer_workers`` trainer actors (``train_group``); returns
    rank 0's summary."""
    settings = config.pipeline
    started = connect(settings)
    rid = run_id(run_dir)
    control = Control.options(name=f"{rid}/control", namespace=NAMESPACE, num_cpus=0).remote(
        settings.rollout_workers, settings.reward_workers
    )
    try:
        return train_group(config, run_dir, resume, rid, control)
    finally:
        ray.kill(control)
        if started:
            ray.shutdown()


class TrainerLost(ProcessLost):
    """A trainer actor died (its node was lost, its process killed)."""


def train_group(config: Config, run_dir: Path, resume: str, rid: str, control) -> dict:
    """The trainer actors, one bundle each of one placement group (packed on as few nodes as
    fit, or spread with ``pipeline.placement=spread``); rank 0 is the run's leader as under
    torchrun, the others its followers, joined by torch.distributed (gloo on CPUs, NCCL on
    GPUs) at rank 0's address. Any actor's error ends the run as it was raised; a dead actor
    ends it as ``TrainerLost`` after every other one is stopped (a follower would wait in a
    collective for a rank that is gone)."""
    settings = config.pipeline
    size = settings.trainer_workers
    group = _placement(settings, size)
    trainers = []
    try:
        for rank in range(size):
            options = {"num_cpus": settings.trainer_cpus, "num_gpus": settings.trainer_gpus}
            if group is not None:
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group=group, placement_group_bundle_index=rank
                )
            name = f"{rid}/trainer" + (f"-{rank}" if rank else "")
            trainers.append(
                TrainerActor.options(name=name, namespace=NAMESPACE, **options).remote(rid, control)
            )
        for rank, trainer in enumerate(trainers):
            what = "the trainer actor" + (f" of rank {rank}" if size > 1 else "")
            wait_ready(
                trainer,
                what,
                settings.trainer_cpus,
                settings.trainer_gpus,
                settings.actor_start_timeout_s,
            )
        leader = ray.get(trainers[0].address.remote()) if size > 1 else ("", 0)
        runs = {
            trainer.train.remote(config, str(run_dir), resume, rank, size, leader): rank
            for rank, trainer in enumerate(trainers)
        }
        return _results(runs)[0]
    finally:
        for trainer in trainers:
            ray.kill(trainer)  # its workers go with rank 0's
        if group is not None:
            remove_placement_group(group)


def _placement(settings: PipelineConfig, size: int):
    """The trainer actors' placement group (None for one actor), ready; a group the cluster
    cannot hold is a ``WorkersUnavailable`` that says what it asked for."""
    if size == 1:
        return None
    bundle = {"CPU": settings.trainer_cpus, "GPU": settings.trainer_gpus}
    bundle = {key: amount for key, amount in bundle.items() if amount} or {"CPU": 0.01}
    strategy = "SPREAD" if settings.placement == "spread" else "PACK"
    group = placement_group([dict(bundle) for _ in range(size)], strategy=strategy)
    try:
        ray.get(group.ready(), timeout=settings.actor_start_timeout_s)
    except GetTimeoutError:
        remove_placement_group(group)
        raise WorkersUnavailable(
            f"the {size} trainer actors (pipeline.trainer_workers) were not placed within "
            f"pipeline.actor_start_timeout_s={settings.actor_start_timeout_s:g}: each asks for "
            f"{bundle}; the cluster has {ray.available_resources()} free. Lower "
            "pipeline.trainer_workers or trainer_cpus / trainer_gpus, or add nodes"
        ) from None
    return group


def _results(runs: dict) -> dict[int, dict]:
    """Each rank's summary, as the ranks finish. The first error ends the wait: a dead actor
    as ``TrainerLost`` (also when another rank's error came first, as a follower's death
    breaks rank 0's collective a moment before Ray reports it), else as it was raised."""
    results, pending = {}, list(runs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        try:
            results[runs[done[0]]] = ray.get(done[0])
        except (RayTaskError, *DEAD) as err:
            for ref in [done[0], *ray.wait(pending, num_returns=len(pending), timeout=5)[0]]:
                try:
                    ray.get(ref)
                except DEAD as dead:
                    raise TrainerLost(
                        f"the trainer actor of rank {runs[ref]} died ({_first_line(dead)}); "
                        "honing train --max-restarts N resumes from the newest checkpoint"
                    ) from None
                except RayTaskError:
                    pass
            raise _cause(err) from None
    return results


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
            join(address, log_to_driver=False)
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


@ray.remote
class TrainerActor:
    """A trainer rank (``run.train_here`` alone, ``torchrun.train_ranks`` in a group); rank
    0's pools are its children."""

    def __init__(self, rid: str, control):
        # Ray ships this class by value: reach the imported module's session, not a copy.
        from honing.backends import ray_run

        ray_run._SESSION.update(run_id=rid, control=control)

    def ready(self) -> bool:
        return True

    def address(self) -> tuple[str, int]:
        """Where the group's store listens: this node's address and a port free there."""
        host = ray.util.get_node_ip_address()
        with socket.socket() as probe:
            probe.bind((host, 0))
            return host, probe.getsockname()[1]

    def train(
        self, config: Config, run_dir: str, resume: str, rank: int = 0, size: int = 1, leader=None
    ) -> dict:
        if size == 1:
            return train_here(config, Path(run_dir), resume, build=build_on_ray)
        # torchrun's environment, for the same ranks (Ray gives each actor its own GPU)
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(size),
            LOCAL_RANK="0",
            MASTER_ADDR=leader[0],
            MASTER_PORT=str(leader[1]),
        )
        build = build_on_ray if rank == 0 else build_follower
        return train_ranks(config, Path(run_dir), resume, stderr_log, build, own_process=False)


# Set in the trainer actor: the run's id and control actor, for ``attach``.
_SESSION: dict = {}


def build_on_ray(config: Config, log=print, group=None) -> Components:
    """``build_components``, then the Ray pools in place of the training engine and scorer."""
    parts = build_components(config, log=log, group=group)
    return attach(config, parts, parts.model_path)


class _OnWorkers(RolloutEngine):
    """A follower rank's stand-in for rank 0's rollout workers: it never samples, and takes
    part in the gathers of their weights (``send_weights``) as rank 0's pool does."""

    computes_here = False

    def __init__(self) -> None:
        super().__init__(Holding.REMOTE)

    def generate(self, requests, params):
        raise RuntimeError("rank 0 samples through the rollout workers")

    def load_weights(self, version: int, weights=None) -> None:
        self.weight_version = version

    def detached_copy(self) -> RolloutEngine:
        return self


def build_follower(config: Config, log=print, group=None) -> Components:
    """A follower rank's parts: rank 0's but for the pools (its rollout workers and reward
    workers sample and score for every rank)."""
    parts = build_components(config, log=log, group=group)
    if config.rollout.engine == "openai":  # every rank's engine joins the servers' sync
        return parts
    stand_in = _OnWorkers()
    for _ in rollout_weights(parts, stand_in):  # rank 0's pool takes version 0 (``attach``)
        pass
    return replace(parts, engine=stand_in)


def attach(config: Config, parts: Components, model_dir: Path) -> Components:
    """Swaps ``parts``' training engine and scorer for the Ray pools (see the module)."""
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
    engine = parts.engine  # rollout.engine=openai: the servers, sampled from this actor
    if config.rollout.engine != "openai":
        control, rid = _SESSION["control"], _SESSION["run_id"]
        engine = RayRolloutEngine(config, model_dir, control, rid, report)
        engine.load_weights(0, rollout_weights(parts, engine))
        if config.rollout.tools and not turns_on_workers(config):
            engine, _ = with_tools(engine, engine, parts.tokenizer, config.rollout)
    scorer = parts.scorer
    if config.pipeline.reward_workers:
        rewards = RewardPool(config, _SESSION["control"], _SESSION["run_id"], report)
        scorer = RayScorer(rewards, parts.scorer)
    return replace(
        parts,
        engine=engine,
        scorer=scorer,
        make_scorer=scorer.sibling if isinstance(scorer, RayScorer) else parts.make_scorer,
    )
