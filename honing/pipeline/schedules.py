"""Where a step's scored batch comes from, and where the weights go after its update, under
each ``schedule.mode``; the loop asks the same two things of either:

- ``Inline`` (``sync``): the batch is generated and scored when the step asks for it, by the
  engine that samples with the policy (idle state offloaded around it,
  ``pipeline/offload.py``), and the new weights go to the engines right after the update
  (every torchrun rank taking part, ``weight_sync.send_weights``).
- ``Ahead`` (``one_step`` / ``async``): ``producer.RolloutProducer`` made the batch on its
  threads, with its own copy of the policy; the new weights are published to it as a copy
  its thread loads when its admission rule says so (a sharded policy's gathered by every
  rank at the step's end, ``weight_sync.publish_ahead``).

``take(step)`` gives the batch and the schedule's metrics; ``publish(step)`` the weights after
update ``step`` and the sync's metrics; ``source_state(next_step)`` the data cursor a
checkpoint must record; ``close()`` stops and says how many samples made ahead were dropped.
"""

from __future__ import annotations

from collections.abc import Callable

from honing.config import Config
from honing.pipeline.collect import Collected, collect
from honing.pipeline.components import Components
from honing.pipeline.offload import Offloader
from honing.pipeline.peers import Op, Peers
from honing.pipeline.producer import RolloutProducer
from honing.pipeline.weight_sync import publish_ahead, send_weights


class Inline:
    """The ``sync`` schedule (see the module)."""

    def __init__(
        self,
        config: Config,
        parts: Components,
        peers: Peers,
        offload: Offloader,
        seed_of: Callable[[int], int],
    ):
        self.config, self.parts, self.peers = config, parts, peers
        self.offload, self.seed_of = offload, seed_of

    def take(self, step: int) -> tuple[Collected, dict[str, float]]:
        offloaded = self.offload.before_generation()
        self.offload.mark()
        got = collect(self.config, self.parts, step, self.seed_of(step))
        return got, offloaded | self.offload.peak("gen")

    def publish(self, step: int) -> dict[str, float]:
        with self.peers.together(Op.SYNC, step):
            sent = send_weights(self.parts, step, kept=True)  # kept until the next update
            return {"perf/sync_mb": sent / 2**20}

    def source_state(self, next_step: int) -> dict | None:
        return None  # the prompt source's own: nothing is drawn ahead

    def close(self) -> int:
        return 0


class Ahead:
    """The ``one_step`` and ``async`` schedules (see the module)."""

    def __init__(
        self,
        config: Config,
        parts: Components,
        peers: Peers,
        start: int,
        seed_of: Callable[[int], int],
    ):
        self.parts, self.peers = parts, peers
        self.producer = RolloutProducer(config, parts, start, seed_of)

    def take(self, step: int) -> tuple[Collected, dict[str, float]]:
        return self.producer.take(step)

    def publish(self, step: int) -> dict[str, float]:
        with self.peers.together(Op.SYNC, step):  # a sharded policy: every rank gathers
            weights = publish_ahead(self.parts, step)
        self.producer.publish(step, weights)
        return {}  # the producer's engine loads them on its own thread

    def source_state(self, next_step: int) -> dict | None:
        return self.producer.source_state(next_step)

    def close(self) -> int:
        return self.producer.close()


def start_schedule(
    config: Config,
    parts: Components,
    peers: Peers,
    offload: Offloader,
    start: int,
    seed_of: Callable[[int], int],
) -> Inline | Ahead:
    """The schedule of ``config.schedule.mode``, for steps after ``start``."""
    if config.schedule.mode == "sync":
        return Inline(config, parts, peers, offload, seed_of)
    return Ahead(config, parts, peers, start, seed_of)
