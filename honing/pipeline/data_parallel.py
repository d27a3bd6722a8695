"""Data-parallel training over torch.distributed, launched with torchrun:

    torchrun --nproc_per_node N -m honing.cli train CONFIG [section.key=value ...] --output-dir DIR

Rank 0 runs the whole loop (generation, scoring, logging, checkpoints). At each update it sends
the step's experience (the padded batch, advantages, old and reference logprobs, the update
settings, the learning rate and the shuffling seed) to the other ranks; every rank then runs
``update_policy`` on its share of the rows, with gradients summed across ranks
(``trainer.update``), so all ranks take the same optimizer step and keep the same weights.
Whenever rank 0's weights change in another way (a resume, a rollback) it sends its weights
and optimizer state with the next update. The other ranks write nothing.

Backend: gloo on the CPU, NCCL on CUDA (one GPU per rank, ``LOCAL_RANK``). PPO's critic
(``algorithm.advantage=gae``) trains the same way: rank 0 computes the values and returns,
every rank fits the critic on its share of the rows, and its weights and optimizer state go
with the policy's when rank 0 sends its state.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist

from honing.pipeline.components import Components
from honing.pipeline.experience import Experience
from honing.rollout.base import GenerationRequest, SamplingParams, chunked
from honing.rollout.speculative import merge_metrics
from honing.trainer.critic import update_critic
from honing.trainer.update import update_policy

TIMEOUT = timedelta(minutes=30)  # a rank waiting longer for the others fails


def world() -> tuple[int, int]:
    """(rank, world size) from torchrun's environment; (0, 1) outside it."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


_JOINED = []  # the group ``init`` created (a caller's own group is left to the caller)


def init(device: torch.device):
    """Joins the process group when launched with several ranks; returns it (or None)."""
    rank, size = world()
    if size <= 1:
        return None
    if not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method="env://", timeout=TIMEOUT)
        _JOINED.append(dist.group.WORLD)
    return dist.group.WORLD


def leave(group, wait: bool) -> None:
    """Destroys the process group ``init`` created. A process that exits with a gloo group
    alive can abort in its C++ teardown ("terminate called without an active exception").
    With ``wait``, first waits until every rank is done with the group, so none closes a
    connection another still reads from; without (a rank failed), leaves at once."""
    if group is None or group not in _JOINED or not dist.is_initialized():
        return
    if wait:
        dist.barrier(group=group)
    _JOINED.remove(group)
    dist.destroy_process_group()


class Leader:
    """Rank 0's side: sends each update's inputs and generation's shares (with its whole
    state first, when the others' copy is out of date)."""

    def __init__(self, group, parts: Components):
        self.group, self.parts = group, parts
        self.send_state = True  # the others built their model from model.path: sync first
        self.busy = False  # inside collectives the others run too (an update, a generation)

    def weights_changed(self) -> None:
        """Rank 0 loaded other weights (resume, rollback): send them with the next message."""
        self.send_state = True

    @contextmanager
    def together(self, payload: dict):
        """Sends ``payload`` (and rank 0's state when due); the body runs rank 0's part of
        the work, in step with the others. Should the body fail, the others are inside its
        collectives where no stop message reaches them: rank 0 just fails (torchrun then
        stops them)."""
        if self.send_state:
            payload = payload | {"state": _state(self.parts)}
            self.send_state = False
        dist.broadcast_object_list([payload], src=0, group=self.group)
        self.busy = True
        yield
        self.busy = False

    def update(self, exp: Experience, settings, seed: int, act: bool, value_clip: float):
        """``together`` for the step's update: the critic's, when there is one, and if
        ``act`` the policy's."""
        payload = {
            "batch": replace(exp.batch, layouts={}),  # a rank makes its own rows' layouts
            "advantages": exp.advantages,
            "old": exp.old_logprobs,
            "ref": exp.ref_logprobs,
            "values": exp.old_values,
            "returns": exp.returns,
            "value_clip": value_clip,
            "act": act,
            "settings": settings,
            "seed": seed,
            "lr": [group["lr"] for group in self.parts.optimizer.param_groups],
        }
        return self.together(payload)

    def stop(self, failed: bool) -> None:
        """Tells the others the run ended, and whether it failed."""
        dist.broadcast_object_list([{"stop": failed}], src=0, group=self.group)


class SpreadEngine:
    """Rank 0's training engine under torchrun: each generate call is cut into tasks of
    ``chunk`` prompts (each seeded by its position, as the Ray backend's are, so the samples
    do not depend on the number of ranks) dealt to the ranks in turn; every rank samples its
    tasks with its own copy of the policy, which updates keep equal to rank 0's, and rank 0
    gathers them. Generation on another thread (``detached_copy``: the one_step and async
    schedules) stays on rank 0."""

    shares_policy = True

    def __init__(self, leader: Leader, local, chunk: int):
        self.leader, self.local, self.chunk = leader, local, chunk
        self._reports, self._ranks = [], 0  # since the last take_report

    @property
    def weight_version(self) -> int:
        return self.local.weight_version

    def load_weights(self, version: int, state_dict: dict | None = None) -> None:
        self.local.load_weights(version)  # the others' copies follow the updates

    def detached_copy(self):
        return self.local.detached_copy()

    def generate(self, requests: list[GenerationRequest], params: SamplingParams):
        tasks = chunked(requests, params, self.chunk)
        leader = self.leader
        with leader.together({"generate": tasks, "version": self.local.weight_version}):
            shares = gather_shares(self.local, tasks, leader.group)
        done = {}
        for rollouts_by_task, report in shares:
            done |= rollouts_by_task
            self._reports.append(report)
        self._ranks = max(self._ranks, sum(1 for by_task, _ in shares if by_task))
        return [rollout for index in sorted(done) for rollout in done[index]]

    def take_report(self):
        """The ranks' engine reports as one, and ``rollout/generation_ranks``: how many
        ranks sampled."""
        reports, self._reports = self._reports, []
        metrics = merge_metrics([metrics for metrics, _ in reports])
        if self._ranks:
            metrics["rollout/generation_ranks"] = float(self._ranks)
        self._ranks = 0
        return metrics, [event for _, events in reports for event in events]


def gather_shares(engine, tasks: list, group) -> list | None:
    """This rank's tasks (every world-size-th, from its rank) sampled with ``engine``,
    gathered on rank 0 as each rank's ({task index: rollouts}, engine report); None
    elsewhere."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    mine = {
        index: engine.generate(requests, params)
        for index, (requests, params) in enumerate(tasks)
        if index % world == rank
    }
    share = (mine, engine.take_report())
    shares = [None] * world if rank == 0 else None
    dist.gather_object(share, shares, dst=0, group=group)
    return shares


def _state(parts: Components) -> dict:
    """What the other ranks load to hold rank 0's weights and optimizer moments."""
    state = {"policy": (parts.policy.state_dict(), parts.optimizer.state_dict())}
    if parts.critic is not None:
        state["critic"] = (parts.critic.state_dict(), parts.critic_optimizer.state_dict())
    return state


@contextmanager
def lead(group, parts: Components) -> Iterator[Leader | None]:
    """Rank 0's ``Leader`` (None without other ranks). However the run ends, the others are
    told it ended and whether it failed, so none waits on the next update; unless it failed
    inside their shared work, where they wait in its collectives instead (``together``)."""
    leader = Leader(group, parts) if group is not None else None
    try:
        yield leader
    except BaseException:
        if leader is not None and not leader.busy:
            leader.stop(failed=True)
        raise
    if leader is not None:
        leader.stop(failed=False)


def follow(parts: Components, group) -> bool:
    """A rank other than 0: runs its share of every update until rank 0 stops; returns
    whether rank 0's run ended well."""
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=group)
        payload = box[0]
        if "stop" in payload:
            return not payload["stop"]
        if "state" in payload:
            state = payload["state"]
            _load(parts.policy, parts.optimizer, *state["policy"])
            if parts.critic is not None:
                _load(parts.critic, parts.critic_optimizer, *state["critic"])
        if "generate" in payload:
            parts.engine.load_weights(payload["version"])  # its copy is rank 0's: the label
            gather_shares(parts.engine, payload["generate"], group)
            continue
        for param_group, lr in zip(parts.optimizer.param_groups, payload["lr"], strict=True):
            param_group["lr"] = lr
        settings, seed = payload["settings"], payload["seed"]
        if parts.critic is not None:
            update_critic(
                parts.critic,
                parts.critic_optimizer,
                payload["batch"],
                payload["values"],
                payload["returns"],
                settings,
                clip=payload["value_clip"],
                generator=torch.Generator().manual_seed(seed + 1),
                group=group,
            )
        if payload["act"]:
            update_policy(
                parts.policy,
                parts.optimizer,
                payload["batch"],
                payload["advantages"],
                settings,
                old_logprobs=payload["old"],
                ref_logprobs=payload["ref"],
                generator=torch.Generator().manual_seed(seed),
                group=group,
            )


def _load(model, optimizer, weights: dict, optimizer_state: dict) -> None:
    model.load_state_dict(weights)
    optimizer.load_state_dict(optimizer_state)
