"""Data-parallel training over torch.distributed, launched with torchrun:

    torchrun --nproc_per_node N -m honing.cli train CONFIG [section.key=value ...] --output-dir DIR

Rank 0 runs the whole loop (generation, scoring, logging, checkpoints); its ``Leader`` is the
loop's ``Peers``. The work the ranks share is announced as an op: at each update rank 0 sends
the step's ``UpdateInputs`` and every rank runs ``apply_update`` on them, its trainer engines
(``Replicated``) running its share of the rows with gradients summed across ranks, so all take
the same optimizer step and keep the same weights. With ``pipeline.spread_generation``, each
generate call is cut into tasks dealt to the ranks (``SpreadEngine``). Whenever rank 0's
weights change in another way (a resume, a rollback) its trainer engines' whole state goes
with the next op. The other ranks write nothing.

Backend: gloo on the CPU, NCCL on CUDA (one GPU per rank, ``LOCAL_RANK``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from honing.config import Config, to_dict
from honing.errors import ConfigError
from honing.host import configure_host, exit_now
from honing.models.loading import resolve_device
from honing.pipeline.components import Components, build_components
from honing.pipeline.experience import forward_passes
from honing.pipeline.peers import Op, checked
from honing.pipeline.run import close, flat, prepare, run_training
from honing.pipeline.state import load_part, save_part
from honing.pipeline.update import UpdateInputs, apply_update
from honing.pipeline.weight_sync import send_weights
from honing.rollout.base import (
    EngineReport,
    GenerationRequest,
    RolloutEngine,
    SamplingParams,
    WeightBuckets,
    chunked,
)
from honing.rollout.native.speculative import merge_metrics

TIMEOUT = timedelta(minutes=30)  # a rank waiting longer for the others fails


def world() -> tuple[int, int]:
    """(rank, world size) from torchrun's environment; (0, 1) outside it."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


_JOINED = []  # the group ``init`` created (a caller's own group is left to the caller)


def init(device: torch.device, alone: bool = False):
    """Joins the process group when launched with several ranks; returns it (or None). With
    ``alone``, one process makes a group of its own (FSDP's offload on one device)."""
    rank, size = world()
    if size <= 1 and not alone:
        return None
    if not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        backend = "nccl" if device.type == "cuda" else "gloo"
        store = dist.HashStore() if size <= 1 else _attempt_store(rank, size)
        dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=TIMEOUT)
        _JOINED.append(dist.group.WORLD)
    return dist.group.WORLD


def _attempt_store(rank: int, size: int):
    """torchrun's store (MASTER_ADDR:MASTER_PORT; its agent's when it keeps one), under a
    prefix of its own per restart: after ``--max-restarts`` brings the ranks back, none may
    read an address the dead ones left there."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size=size,
        is_master=not agent and rank == 0,
        timeout=TIMEOUT,
        multi_tenant=not agent,
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"honing/attempt_{attempt}", store)


def offloads_alone(config: Config) -> bool:
    """Sharding on one CUDA device with ``memory.param_offload``: FSDP over a group of one
    keeps the parameters on the host (a model larger than the device trains there)."""
    from honing.models.loading import resolve_device

    wanted = config.trainer.strategy == "fsdp" and config.memory.param_offload
    return wanted and resolve_device(config.model.device).type == "cuda"


def leave(group, wait: bool) -> None:
    """Destroys the process group ``init`` created. A process that exits with a gloo group
    alive can abort in its C++ teardown ("terminate called without an active exception").
    With ``wait``, first waits until every rank is done with the group, so none closes a
    connection another still reads from; without (a rank failed), leaves at once."""
    if group is None or group not in _JOINED:
        return
    _JOINED.remove(group)
    if dist.is_initialized():  # (vLLM's shutdown may have destroyed it already)
        if wait:
            dist.barrier(group=group)
        dist.destroy_process_group()
    # destroy_process_group does not join gloo's worker threads. A worker that ran the last
    # collective may still be dropping that work, whose tensors' Python objects need the GIL;
    # if the interpreter is finalizing by then, the worker is forced to exit through a noexcept
    # frame and the process aborts ("terminate called without an active exception"). A short
    # sleep hands the GIL over so the workers finish before this rank goes on to exit.
    time.sleep(0.1)


def train_ranks(
    config: Config,
    run_dir: Path,
    resume: str,
    log,
    build: Callable[..., Components] = build_components,
    own_process: bool = True,
) -> dict:
    """The run on this rank: rank 0 trains as one process would, with the others as its
    peers; the others follow it. Returns rank 0's summary ({} elsewhere). ``build``: how
    this rank's parts are made (the Ray backend's trainer actors swap in their pools);
    ``own_process``: a follower that ended well exits here (torchrun's ranks; a Ray actor's
    process is its owner's to end)."""
    rank, _ = world()
    prepared = prepare(config, run_dir, resume) if rank == 0 else None
    group = parts = None
    try:  # from here on, rank 0 lets the run directory go however the run ends
        configure_host(config.trainer.threads)
        torch.manual_seed(config.trainer.seed)
        group = init(resolve_device(config.model.device), alone=offloads_alone(config))
        check_same_config(config, group)
        quiet = rank != 0  # rank 0 says what the build found (the others find the same)
        parts = build(config, log=(lambda message: None) if quiet else log, group=group)
        result, ended_well = {}, True
        if rank != 0:
            ended_well = follow(parts, group, config)  # rank 0 logs and writes
        else:
            with lead(group, parts, config) as leader:
                result = run_training(config, run_dir, parts, prepared, log, peers=leader)
        if ended_well and group is not None:  # all ranks together, unless one failed
            dist.barrier(group=group)
        # the engines first: vLLM in a rank tears down the process group it joined
        done, parts = parts, None
        close(done)
        leave(group, wait=False)
        if rank != 0 and ended_well and own_process:  # a follower has nothing left to write
            exit_now()
        return result
    finally:
        if parts is not None:  # this rank failed
            close(parts)
        leave(group, wait=False)  # after a leave, nothing
        if prepared is not None:  # rank 0 lets the run directory go
            prepared.release()


REPLICATED_OPS = frozenset({Op.UPDATE, Op.GENERATE})
SHARDED_OPS = frozenset(Op)


def check_same_config(config: Config, group) -> None:
    """Every rank was launched with the same config, or each fails at once with one line."""
    if group is None:
        return
    mine = flat(to_dict(config))
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    for rank, theirs in enumerate(every):
        if theirs != every[0]:
            keys = sorted(
                k for k in every[0].keys() | theirs.keys() if every[0].get(k) != theirs.get(k)
            )
            leave(group, wait=True)  # every rank found it: all say so before any exits
            raise ConfigError(
                f"rank {rank} was launched with another config than rank 0 (differs in: "
                f"{', '.join(keys[:5])}); start every rank with the same command"
            )


class Leader:
    """Rank 0's side (the loop's ``Peers``): announces each op the ranks share (replicated
    modules: the update and spread generation; sharded ones: every pass, weight sync and
    checkpoint too), with its trainer engines' whole state first when the others' copy of a
    replicated module is out of date (a sharded run's ranks load their own shards)."""

    def __init__(self, group, parts: Components, config: Config):
        self.group, self.parts, self.config = group, parts, config
        policy = parts.trainers.policy
        sharded = policy.is_sharded
        self.shared = SHARDED_OPS if sharded else REPLICATED_OPS
        if policy.passes_together and not sharded:  # sequence-parallel replicas
            self.shared = REPLICATED_OPS | {Op.FORWARD}
        self.send_state = not sharded  # replicas built from model.path: rank 0's state first
        self.busy = False  # inside collectives the others run too (an update, a generation)
        self.announced = False  # inside an op the others run

    def weights_changed(self) -> None:
        """Rank 0 loaded other weights (resume, rollback): send them with the next op (a
        sharded run's ranks loaded theirs in the ``load`` op)."""
        self.send_state = self.shared is REPLICATED_OPS

    def spread(self, engine: RolloutEngine, role: str = "engine") -> RolloutEngine:
        """With ``pipeline.spread_generation``, the calls of an engine that computes in this
        process (honing's, vLLM in process; each rank has its own) dealt to every rank
        (``SpreadEngine``); not with MTP heads, which draft on rank 0 alone. ``role``: the
        field of ``Components`` it is (``engine``, ``val_engine``), the others' engine for
        its calls."""
        settings = self.config.pipeline
        if settings.spread_generation and engine.computes_here and self.parts.trainers.mtp is None:
            return SpreadEngine(self, engine, settings.rollout_chunk, role)
        return engine

    @contextmanager
    def together(self, op: Op, payload):
        """Sends ``op`` and its ``payload`` (and rank 0's state when due), when the others
        take part in it; the body runs rank 0's part of the work, in step with theirs. Should
        the body fail, the others are inside its collectives where no stop message reaches
        them: rank 0 just fails (torchrun then stops them)."""
        if checked(op) not in self.shared:
            yield
            return
        wire = payload.for_wire() if isinstance(payload, UpdateInputs) else payload
        message = {"op": op, "payload": wire}
        if self.send_state:
            message["state"] = {t.role: t.state() for t in self.parts.trainers.all()}
            self.send_state = False
        dist.broadcast_object_list([message], src=0, group=self.group)
        self.busy = self.announced = True
        yield
        self.busy = self.announced = False

    def tell(self, value) -> None:
        """Within an announced op, a value rank 0 decided on the way (a save's directory)."""
        if self.announced:
            dist.broadcast_object_list([value], src=0, group=self.group)

    def stop(self, failed: bool) -> None:
        """Tells the others the run ended, and whether it failed."""
        dist.broadcast_object_list([{"op": None, "failed": failed}], src=0, group=self.group)


@contextmanager
def lead(group, parts: Components, config: Config) -> Iterator[Leader | None]:
    """Rank 0's ``Leader`` (None without other ranks). However the run ends, the others are
    told it ended and whether it failed, so none waits on the next op; unless it failed
    inside their shared work, where they wait in its collectives instead (``together``)."""
    leader = Leader(group, parts, config) if group is not None else None
    try:
        yield leader
    except BaseException:
        if leader is not None and not leader.busy:
            leader.stop(failed=True)
        raise
    if leader is not None:
        leader.stop(failed=False)


@dataclass(frozen=True)
class Follower:
    """A rank other than 0, as an op's part on it sees it: its run's parts, the group, the
    config, and ``receive`` (the next value rank 0 broadcasts within the op)."""

    parts: Components
    group: Any
    config: Config
    receive: Callable[[], Any]


def _generate(me: Follower, payload) -> None:
    role, version, tasks = payload
    engine = getattr(me.parts, role)
    if engine.weight_version != version:
        # A replicated policy: the module is rank 0's (the updates keep it so), and an engine
        # that holds weights of its own (vLLM) loads them from it now. A sharded one's engines
        # loaded this version in the sync op, which every rank runs.
        send_weights(me.parts, version, remote=False)
    gather_shares(engine, tasks, me.group)


# What a follower runs for each op rank 0 announces: every member of Op has its entry.
FOLLOWERS: dict[Op, Callable[[Follower, Any], None]] = {
    Op.UPDATE: lambda me, payload: apply_update(me.parts.trainers, payload),
    Op.GENERATE: _generate,
    Op.FORWARD: lambda me, payload: forward_passes(me.parts, *payload),
    Op.SYNC: lambda me, payload: send_weights(me.parts, payload, remote=False),  # rank 0 sends
    Op.SAVE: lambda me, payload: save_part(me.parts, me.config, me.receive),
    Op.LOAD: lambda me, payload: load_part(me.parts, payload),
}


def follow(parts: Components, group, config: Config) -> bool:
    """A rank other than 0: runs its part of each op rank 0 announces until it stops;
    returns whether rank 0's run ended well."""

    def receive():
        box = [None]
        dist.broadcast_object_list(box, src=0, group=group)
        return box[0]

    me = Follower(parts, group, config, receive)
    while True:
        message = receive()
        op = message["op"]
        if op is None:  # rank 0's run ended
            return not message["failed"]
        for trainer in parts.trainers.all():
            if trainer.role in message.get("state", {}):
                trainer.load_state(message["state"][trainer.role])
        FOLLOWERS[op](me, message.get("payload"))


class SpreadEngine(RolloutEngine):
    """Rank 0's engine under torchrun: each generate call is cut into tasks of ``chunk``
    prompts (each seeded by its position, as the Ray backend's are, so the samples do not
    depend on the number of ranks) dealt to the ranks in turn; every rank samples its tasks
    with its own copy of the policy, which updates keep equal to rank 0's, and rank 0 gathers
    them. Generation on another thread (``detached_copy``: the one_step and async schedules)
    stays on rank 0."""

    def __init__(self, leader: Leader, local: RolloutEngine, chunk: int, role: str = "engine"):
        # As rank 0's engine holds: a replicated policy shared (the others' copies follow the
        # updates), or its own copy of a sharded one (every rank's takes the weights).
        super().__init__(local.holds)
        self.leader, self.local, self.chunk, self.role = leader, local, chunk, role
        self._reports, self._ranks = [], 0  # since the last take_report

    @property
    def weight_version(self) -> int:
        return self.local.weight_version

    def load_weights(self, version: int, weights: WeightBuckets | None = None) -> None:
        self.local.load_weights(version, weights)

    def detached_copy(self) -> RolloutEngine:
        return self.local.detached_copy()

    def step_done(self, metrics: dict[str, float]) -> None:
        self.local.step_done(metrics)

    def generate(self, requests: list[GenerationRequest], params: SamplingParams):
        tasks = chunked(requests, params, self.chunk, by_index=self.local.seeds_by_index)
        leader = self.leader
        with leader.together(Op.GENERATE, (self.role, self.local.weight_version, tasks)):
            shares = gather_shares(self.local, tasks, leader.group)
        done = {}
        for rollouts_by_task, report in shares:
            done |= rollouts_by_task
            self._reports.append(report)
        self._ranks = max(self._ranks, sum(1 for by_task, _ in shares if by_task))
        return [rollout for index in sorted(done) for rollout in done[index]]

    def take_report(self) -> EngineReport:
        """The ranks' engine reports as one, and ``rollout/generation_ranks``: how many
        ranks sampled."""
        reports, self._reports = self._reports, []
        metrics = merge_metrics([metrics for metrics, _ in reports])
        if self._ranks:
            metrics["rollout/generation_ranks"] = float(self._ranks)
        self._ranks = 0
        return metrics, [event for _, events in reports for event in events]


def gather_shares(engine: RolloutEngine, tasks: list, group) -> list | None:
    """This rank's tasks sampled with ``engine``, gathered on rank 0 as each rank's ({task
    index: rollouts}, engine report); None elsewhere. The ranks that run one engine together
    (``shared_by_ranks`` consecutive ones: tensor parallel) form a slot, and slot s takes
    every slots-th task from s; each of its ranks runs them, the first one's are kept."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    together = engine.shared_by_ranks
    slots, slot = size // together, rank // together
    mine = {
        index: engine.generate(requests, params)
        for index, (requests, params) in enumerate(tasks)
        if index % slots == slot
    }
    share = (mine, engine.take_report())
    if rank % together:  # the slot's first rank hands in the same samples
        share = ({}, ({}, []))
    shares = [None] * size if rank == 0 else None
    dist.gather_object(share, shares, dst=0, group=group)
    return shares
