"""The policy's new weights to the rollout engines, after each update and after a load.

Each engine gets them in the form it holds the model (``RolloutEngine.in_process``): an
in-process copy of the policy module takes the module's own tensors (a LoRA wrapper's
included; the MTP heads it shares need nothing); an engine in other processes (Ray workers,
inference servers) holds the plain model and takes a LoRA policy's adapters merged into the
base weights, with the MTP heads trained here under ``MTP_PREFIX``. Either way the weights go
as (name, tensor) pieces in the trainer engine's bounded buckets, so no whole copy of the model
is made to send it; an engine that shares the trainer's module only learns the version.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from honing.models.loading import plain_weight_items
from honing.pipeline.components import Components
from honing.rollout.base import RolloutEngine
from honing.rollout.mtp import MTP_PREFIX


def rollout_weights(parts: Components, engine: RolloutEngine) -> Iterator[tuple[str, torch.Tensor]]:
    """The pieces ``engine`` loads to sample with the policy's current weights."""
    trainers = parts.trainers
    if engine.in_process:
        for bucket in trainers.policy.weights():
            yield from bucket
        return
    for bucket in trainers.policy.weights(plain_weight_items):
        yield from bucket
    if trainers.mtp is not None:
        for bucket in trainers.mtp.weights():
            yield from ((MTP_PREFIX + name, tensor) for name, tensor in bucket)


def send_weights(parts: Components, version: int) -> None:
    """Makes the engines sample from the policy's current weights as ``version``: the
    in-process validation engine shares the module (it records the version); a training
    engine that does not share it is sent the weights."""
    parts.val_engine.load_weights(version)
    if parts.engine.shares_policy:
        parts.engine.load_weights(version)
    else:
        parts.engine.load_weights(version, rollout_weights(parts, parts.engine))


def snapshot(parts: Components, engine: RolloutEngine) -> list[tuple[str, torch.Tensor]]:
    """A copy of ``rollout_weights`` that later updates leave alone: what a producer thread
    loads into its own engine while the trainer goes on (one_step / async)."""
    return [(name, tensor.detach().clone()) for name, tensor in rollout_weights(parts, engine)]
