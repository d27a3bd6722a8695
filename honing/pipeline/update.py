"""One step's update, as the loop and every other torchrun rank run it: the critic's fit
(``algorithm.advantage=gae``), then the policy's PPO epochs, each on its trainer engine.

``UpdateInputs`` is everything the update needs from the step; under torchrun rank 0 sends it
to the other ranks (``honing.backends.torchrun``) and every rank calls ``apply_update`` with
it, so the update is written once.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from honing.pipeline.components import Trainers
from honing.seeds import CRITIC_OFFSET
from honing.trainer.batch import TrainBatch
from honing.trainer.critic import update_critic
from honing.trainer.policy_update import UpdateSettings, update_policy


@dataclass(frozen=True)
class UpdateInputs:
    """A step's experience and settings for the update (tensors [N, R] beside the batch)."""

    batch: TrainBatch
    advantages: torch.Tensor
    old_logprobs: torch.Tensor | None
    ref_logprobs: torch.Tensor | None
    old_values: torch.Tensor | None  # gae: the critic's values before its update
    returns: torch.Tensor | None  # gae: the critic's targets
    settings: UpdateSettings
    seed: int  # the step's seed: the mini-batches' shuffle
    act: bool  # False while the critic warms up: the policy waits
    value_clip: float
    lr: tuple[float, ...]  # the policy's learning rate per parameter group, this step

    def for_wire(self) -> UpdateInputs:
        """Without the batch's cached packed layouts (a rank makes its own rows')."""
        return replace(self, batch=replace(self.batch, layouts={}))


def apply_update(trainers: Trainers, inputs: UpdateInputs) -> dict[str, float]:
    """The critic's fit, then (if ``inputs.act``) the policy's update; their metrics."""
    trainers.policy.set_learning_rates(inputs.lr)
    metrics: dict[str, float] = {}
    if trainers.critic is not None:
        metrics |= update_critic(
            trainers.critic,
            inputs.batch,
            inputs.old_values,
            inputs.returns,
            inputs.settings,
            clip=inputs.value_clip,
            generator=torch.Generator().manual_seed(inputs.seed + CRITIC_OFFSET),
        )
    if inputs.act:
        metrics |= update_policy(
            trainers.policy,
            inputs.batch,
            inputs.advantages,
            inputs.settings,
            old_logprobs=inputs.old_logprobs,
            ref_logprobs=inputs.ref_logprobs,
            generator=torch.Generator().manual_seed(inputs.seed),
        )
    return metrics
