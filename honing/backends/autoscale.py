"""How many rollout workers the Ray backend wants (``pipeline.autoscale_max`` > 0), decided
from where each step waited; ``RayRolloutEngine.step_done`` feeds it every step's metrics and
sets the run's control target to what it answers. Plain logic: no Ray here.

The rule aims at generation that just keeps up with the trainer. It assumes a batch's
generation time is inversely proportional to the number of workers (each takes whole tasks of
``pipeline.rollout_chunk`` prompts), and changes the count by one at a time:

- **Grow** when the trainer waited for generation. Under ``schedule.mode=one_step|async``:
  ``timing_s/trainer_idle`` above ``WAIT_FRACTION`` of the step (``timing_s/step``). Under
  ``sync`` the trainer always waits while the batch is generated, and the rollout workers
  always wait through the trainer's work on it (``timing_s/prepare`` + ``timing_s/update``):
  grow while generation (``timing_s/gen``) takes longer than that work. A step in which the
  trainer waited counts for growth even if generation waited too (a long tail makes both
  wait in turn): the trainer's wait is the one that costs the step time.
- **Shrink** when generation waited for the trainer so long that one worker fewer would still
  keep up: under ``one_step|async``, ``timing_s/engine_idle`` (generation held back by
  admission) above 1/N of the step with N workers (and above ``WAIT_FRACTION``); under
  ``sync``, generation times N/(N-1) still shorter than the trainer's work. A count reached by
  growing is then not shrunk back at once (its N-1 did not keep up), so the count does not
  swing between two values while the workload stays the same.
- Either only after ``pipeline.autoscale_patience`` steps in a row that wait the same way; a
  step that waits neither way (or has no update: a skipped step) breaks the run of steps.
  After a change the count starts again: the next change needs that many fresh steps.
- Never below ``pipeline.autoscale_min``; never above ``pipeline.autoscale_max`` nor above the
  tasks one generation call has (``ceil(rollout.batch_size / pipeline.rollout_chunk)``): a
  worker beyond them would have no task to take.

Limits: generation that does not speed up with workers (one long sample holding a task, a
shared server) makes the trainer wait whatever the count, and the rule grows to the top of
its bounds; dynamic sampling's extra rounds and partial rollouts' chunks call generation with
other numbers of prompts than the batch's, which the task cap does not see.
"""

from __future__ import annotations

from dataclasses import dataclass

from honing.config import Config

WAIT_FRACTION = 0.1  # a wait shorter than this share of the step is noise, not a signal


@dataclass(frozen=True)
class Change:
    """A new worker count and why."""

    before: int
    after: int
    reason: str


class Autoscaler:
    """Fed each step's metrics (``observe``); answers a ``Change`` of the rollout workers'
    target when the rule above calls for one, else None."""

    def __init__(
        self,
        workers: int,
        minimum: int,
        maximum: int,
        patience: int,
        tasks: int,
        asynchronous: bool,
    ):
        """``workers``: the count to start from; ``tasks``: rollout tasks per generation call;
        ``asynchronous``: the batch is made ahead (``schedule.mode=one_step|async``)."""
        self.workers = workers
        self.minimum, self.maximum = minimum, max(min(maximum, tasks), minimum)
        self.patience, self.asynchronous = patience, asynchronous
        self._streak: tuple[int, int] = (0, 0)  # (direction: +1 | -1 | 0, steps in a row)

    def observe(self, metrics: dict[str, float]) -> Change | None:
        """The step's metrics (``timing_s/*``); a change once a wait lasted ``patience``
        steps and the bounds leave room for it."""
        direction, reason = (self._waits_async if self.asynchronous else self._waits_sync)(metrics)
        same, count = self._streak
        count = count + 1 if direction == same else 1
        self._streak = (direction, count)
        if direction == 0 or count < self.patience:
            return None
        after = self.workers + direction
        if not self.minimum <= after <= self.maximum:
            return None
        change = Change(self.workers, after, f"{reason}, {count} step(s) in a row")
        self.workers, self._streak = after, (0, 0)
        return change

    def _waits_async(self, metrics: dict[str, float]) -> tuple[int, str]:
        step = metrics.get("timing_s/step", 0.0)
        trainer = metrics.get("timing_s/trainer_idle", 0.0)
        engine = metrics.get("timing_s/engine_idle", 0.0)
        if step <= 0:
            return 0, ""
        if trainer > WAIT_FRACTION * step:
            return 1, f"the trainer waited {trainer:.3g} s of a {step:.3g} s step for a batch"
        if self.workers > 1 and engine > max(WAIT_FRACTION, 1 / self.workers) * step:
            return -1, (
                f"generation waited {engine:.3g} s of a {step:.3g} s step for the trainer: "
                f"{self.workers - 1} worker(s) would keep up"
            )
        return 0, ""

    def _waits_sync(self, metrics: dict[str, float]) -> tuple[int, str]:
        if "timing_s/update" not in metrics:  # no update to compare with
            return 0, ""
        generation = metrics.get("timing_s/gen", 0.0)
        work = metrics["timing_s/update"] + metrics.get("timing_s/prepare", 0.0)
        if generation > work:
            return 1, f"generation took {generation:.3g} s, the trainer's work {work:.3g} s"
        fewer = self.workers - 1
        if fewer >= 1 and generation * self.workers / fewer < work:
            return -1, (
                f"generation took {generation:.3g} s, the trainer's work {work:.3g} s: "
                f"{fewer} worker(s) would take less"
            )
        return 0, ""


def rollout_tasks(config: Config) -> int:
    """The rollout tasks one batch's generation call has: its prompts in tasks of
    ``pipeline.rollout_chunk``."""
    return -(-config.rollout.batch_size // config.pipeline.rollout_chunk)


def autoscaler_for(config: Config) -> Autoscaler | None:
    """The run's autoscaler, or None when ``pipeline.autoscale_max`` is 0."""
    settings = config.pipeline
    if not settings.autoscale_max:
        return None
    return Autoscaler(
        workers=settings.rollout_workers,
        minimum=settings.autoscale_min,
        maximum=settings.autoscale_max,
        patience=settings.autoscale_patience,
        tasks=rollout_tasks(config),
        asynchronous=config.schedule.mode != "sync",
    )
