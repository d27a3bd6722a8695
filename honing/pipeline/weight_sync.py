"""The policy's new weights to the rollout engines, after each update and after a load.

Each engine gets them in the form it holds the model (``RolloutEngine.holds``): an
in-process copy of the policy module takes the module's own tensors (a LoRA wrapper's
included; the MTP heads it shares need nothing); an engine in other processes (Ray workers,
inference servers) holds the plain model and takes a LoRA policy's adapters merged into the
base weights, with the MTP heads trained here under ``MTP_PREFIX``. Either way the weights go
as the trainer engine's buckets of (name, tensor) pieces (``rollout.weight_bucket_mb`` each),
made as the engine asks for them, so no whole copy of the model is made to send it; an engine
that shares the trainer's module only learns the version. ``send_weights`` returns the bytes
it sent: the step's ``perf/sync_mb``.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

from honing.models.loading import plain_weight_items
from honing.pipeline.components import Components
from honing.rollout.base import Holding, RolloutEngine, WeightBucket, WeightStream
from honing.rollout.native.mtp import MTP_PREFIX


def rollout_weights(parts: Components, engine: RolloutEngine) -> Iterator[WeightBucket]:
    """The buckets ``engine`` loads to sample with the policy's current weights."""
    trainers = parts.trainers
    if engine.holds is not Holding.REMOTE:
        yield from trainers.policy.weights()
        return
    yield from trainers.policy.weights(plain_weight_items)
    if trainers.mtp is not None:
        for bucket in trainers.mtp.weights():
            yield [(MTP_PREFIX + name, tensor) for name, tensor in bucket]


def send_weights(parts: Components, version: int, remote: bool = True, kept: bool = False) -> int:
    """Makes the engines sample from the policy's current weights as ``version``: one that
    shares the trainer's module records the version; any other is sent the weights. Under a
    sharded layout every rank runs this (each tensor is gathered from all of them) and each
    loads its own in-process engines (vLLM in each rank included); the weights go to engines
    elsewhere (inference servers) from rank 0 alone (``remote``), the others taking part in
    the gathers only.

    ``kept``: the trainer keeps these weights until the next call and nothing samples while
    they change (the sync schedule), so an engine may read them again from the live module
    to send them once more (a server that comes back); not under a sharded layout, whose
    reads every rank must join."""
    sent = 0

    def counted(buckets):
        nonlocal sent
        for bucket in buckets:
            sent += sum(tensor.numel() * tensor.element_size() for _, tensor in bucket)
            yield bucket

    for engine in dict.fromkeys([parts.val_engine, parts.engine]):  # the same one once
        if engine.holds is Holding.SHARED:
            engine.load_weights(version)
        elif engine.holds is Holding.COPY or remote or engine.computes_here:
            again = None
            if kept and not parts.trainers.policy.is_sharded:
                again = partial(rollout_weights, parts, engine)
            stream = WeightStream(counted(rollout_weights(parts, engine)), again)
            engine.load_weights(version, stream)
        else:
            for _ in rollout_weights(parts, engine):
                pass
    return sent


def snapshot(parts: Components, engine: RolloutEngine) -> list[WeightBucket]:
    """A copy of ``rollout_weights``, bucket by bucket, that later updates leave alone: what
    a producer thread loads into its own engine while the trainer goes on (one_step /
    async)."""
    return [_copied(bucket) for bucket in rollout_weights(parts, engine)]


def _copied(bucket: WeightBucket) -> WeightBucket:
    return [(name, tensor.detach().clone()) for name, tensor in bucket]


def publish_ahead(parts: Components, version: int) -> list[WeightBucket]:
    """After update ``version`` under the schedules that generate ahead: the validation
    engine samples with the new weights, and the return is a ``snapshot`` for the producer's
    copy of ``parts.engine`` (which this does not touch: the producer's thread loads it).
    Each engine's weights are made in one pass, in the order ``send_weights`` takes them on
    the other ranks (one pass when the two are one engine), so a sharded layout's gathers
    meet theirs."""
    kept: list[WeightBucket] = []

    def keeping(buckets):
        for bucket in buckets:
            kept.append(_copied(bucket))
            yield bucket

    val = parts.val_engine
    if val.holds is Holding.SHARED:
        val.load_weights(version)
    else:  # a sharded policy: the validation engine's own copy
        buckets = rollout_weights(parts, val)
        val.load_weights(version, keeping(buckets) if val is parts.engine else buckets)
    if val is not parts.engine or val.holds is Holding.SHARED:
        kept = snapshot(parts, parts.engine)
    return kept
