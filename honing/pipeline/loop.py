"""The training loop: generate -> score -> update, under each schedule.

A step (``TrainLoop.train_step``) runs the stages by name: generate and score a batch
(``group_size`` completions of ``batch_size`` prompts), its advantages, the update, and the
sync of the new weights to the rollout engines; then the loop logs, validates, checkpoints
and acts on alerts. Where the batch comes from is the schedule's (``pipeline/schedules.py``):
under ``schedule.mode=sync`` it is made right then, by the in-process engine that shares the
policy; under ``one_step`` / ``async`` it was made ahead by ``producer.RolloutProducer`` on
other threads (with its own copy of the policy, which gets each new version). The step's
metric arithmetic is ``step_metrics``'s. Every generated
sample is accounted for: generated = trained + filtered + failed + stale, where failed counts
the samples whose score failed and were dropped (``reward.on_error=drop``) and stale those
that arrived staler than ``schedule.max_staleness``; ``samples/score_errors`` counts every
failed score, also those trained with a recorded 0 (``reward.on_error=zero``).
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import torch

from honing.checkpoint import CheckpointManager
from honing.checkpoint.manager import INTERRUPT_GRACE_S
from honing.config import Config
from honing.errors import RunStopped
from honing.monitor import RunLogger
from honing.pipeline.alerting import Alerting, Decision, set_aside_newer
from honing.pipeline.collect import Collected
from honing.pipeline.components import Components
from honing.pipeline.evaluate import validate
from honing.pipeline.experience import Experience, make_experience
from honing.pipeline.offload import Offloader
from honing.pipeline.peers import Alone, Op, Peers
from honing.pipeline.schedules import Ahead, Inline, start_schedule
from honing.pipeline.state import load_training_state, save_training_state
from honing.pipeline.step_metrics import step_metrics
from honing.pipeline.update import UpdateInputs, apply_update
from honing.rollout.tools.turns import tool_record
from honing.seeds import step_seed, validation_seed
from honing.trainer.mtp import train_mtp
from honing.types import Rollout, Score


class TrainLoop:
    """Runs steps ``start+1 .. total_steps`` of one run; ``peers``: the run's other processes
    (torchrun ranks), which share its updates and may share its generation."""

    def __init__(
        self,
        config: Config,
        parts: Components,
        logger: RunLogger,
        checkpoints: CheckpointManager,
        peers: Peers | None = None,
    ):
        self.peers = peers or Alone()
        self.config = config
        engine = self.peers.spread(parts.engine)  # under torchrun every rank may sample
        same = parts.val_engine is parts.engine  # then it stays one engine
        val_engine = engine if same else self.peers.spread(parts.val_engine, "val_engine")
        parts = replace(parts, engine=engine, val_engine=val_engine)
        self.parts = parts
        self.logger = logger
        self.checkpoints = checkpoints
        self.schedule: Inline | Ahead | None = None  # where batches come from (started by run)
        self.adjusted: dict[str, float] = {}  # alert rollbacks' temperature and kl_coef
        self._heads_due = None  # (batch, seed): the MTP heads' step still to take
        self.offload = Offloader(config.memory, config.schedule.mode, parts, logger.log_event)

    def run(self, start_step: int) -> None:
        cfg = self.config.trainer
        alerting = Alerting(self.config.monitor, self.logger, self.checkpoints.root.parent)
        step = start_step
        self._start_schedule(start_step)
        try:
            if start_step == 0 and cfg.val_at_start:
                self.logger.log_metrics(0, self._validate(0))
            while step < cfg.total_steps:
                step += 1
                metrics = self.train_step(step)
                last = step == cfg.total_steps
                if last or (cfg.val_every and step % cfg.val_every == 0):
                    metrics |= self._validate(step)
                metrics |= self.checkpoints.mirror_metrics()  # uploads that ended meanwhile
                self.parts.engine.step_done(metrics)  # e.g. Ray's workers scale by its waits
                self.logger.log_metrics(step, metrics)
                decision = alerting.after_step(step, metrics)
                if decision is not None:
                    step = self._act(decision, step, alerting)
                    continue
                every = self.config.checkpoint.every
                if last or (every and step % every == 0):
                    self._save(step)
        except KeyboardInterrupt:  # Ctrl-C, SIGTERM: uploads under way get a short while
            self._end(step, alerting, upload_wait_s=INTERRUPT_GRACE_S)
            raise
        except BaseException:
            self._end(step, alerting)
            raise
        self._end(step, alerting)

    def _end(self, step: int, alerting: Alerting, upload_wait_s: float = 600.0) -> None:
        """The schedule stopped, the mirror's queued uploads awaited, the alerts closed:
        each whatever the one before it raised."""
        try:
            self._stop_schedule(step, "end of run")
        finally:
            try:
                self.checkpoints.finish_uploads(upload_wait_s)
            finally:
                alerting.close()

    def _start_schedule(self, start_step: int) -> None:
        """Batches made now (``sync``) or ahead on other threads (``one_step`` / ``async``),
        for the steps after ``start_step``, with the parts as they are now."""
        self.schedule = start_schedule(
            self.config, self.parts, self.peers, self.offload, start_step, self._seed_of
        )

    def _stop_schedule(self, step: int, reason: str) -> None:
        """Stops the schedule; samples made for later steps are discarded, and said so."""
        if self.schedule is None:
            return
        discarded = self.schedule.close()
        self.schedule = None
        if discarded:
            self.logger.log_event("rollouts_discarded", step=step, samples=discarded, reason=reason)

    def _save(self, step: int, required: bool | None = None):
        source = self.schedule.source_state(step + 1) if self.schedule else None
        return save_training_state(
            self.checkpoints,
            self.parts,
            self.config,
            step,
            required,
            source_state=source,
            peers=self.peers,
            adjusted=self.adjusted,
        )

    def _act(self, decision: Decision, step: int, alerting: Alerting) -> int:
        """Stop (checkpoint, raise ``RunStopped``) or roll back; returns the step to go on
        from."""
        rule = decision.firing.rule.text
        target = None
        if decision.action == "rollback":
            good = self.checkpoints.latest_good(at_most=decision.firing.good_step)
            if alerting.rollbacks >= self.config.monitor.max_rollbacks:
                reason = f"monitor.max_rollbacks={self.config.monitor.max_rollbacks} reached"
            elif good is None:
                reason = f"no good checkpoint at or before step {decision.firing.good_step}"
            else:
                target = good
            if target is None:
                self.logger.log_event("rollback_refused", step=step, rule=rule, reason=reason)
        if target is None:
            path = self._save(step, required=True)
            self.logger.log_event("stopped", step=step, rule=rule, checkpoint=str(path))
            raise RunStopped(f"stopped by alert {rule!r} at step {step}; checkpoint {path}")
        alerting.rollbacks += 1
        changes = decision.firing.rule.rollback
        self._stop_schedule(step, "rollback")
        target = self._rollback_to(target, changes)
        self._start_schedule(target)
        alerting.rules.reset()
        abandoned = set_aside_newer(self.checkpoints, target, lambda message: None)
        self.checkpoints.abandon_mirror_after(target)
        dropped = self.logger.truncate_after(target)
        self.logger.log_event(
            "rollback",
            step=step,
            to_step=target,
            rule=rule,
            changes=changes,
            count=alerting.rollbacks,
            abandoned=abandoned,
            dropped=dropped,
        )
        return target

    def _rollback_to(self, checkpoint: Path, changes: dict[str, float]) -> int:
        """Reload ``checkpoint`` and apply the rollback's changes on top; returns the
        checkpoint's step. The learning-rate scale accumulates over the run's rollbacks,
        whichever checkpoint each returns to (a second rollback to the same checkpoint
        halves again what did not help the first time)."""
        parts = self.parts
        policy = parts.trainers.policy
        scale = policy.lr_scale * changes.get("lr_scale", 1.0)
        step = load_training_state(parts, checkpoint, self.peers)
        self.peers.weights_changed()
        policy.scale_lr(scale)
        if "kl_coef" in changes:  # the reward penalty's (saved with the checkpoint's state)
            parts.kl_controller.value = changes["kl_coef"]
        self.adjust({k: v for k, v in changes.items() if k != "lr_scale"})
        return step

    def adjust(self, settings: dict[str, float]) -> None:
        """Samples and trains with an alert rollback's ``temperature`` and ``kl_coef`` (the
        KL loss term's) from now on; checkpoints record them, and a resumed run calls this
        with what its checkpoint recorded."""
        parts = self.parts
        sampling, update = parts.train_sampling, parts.update_settings
        if "temperature" in settings:
            sampling = replace(sampling, temperature=settings["temperature"])
            update = replace(update, temperature=settings["temperature"])
        if "kl_coef" in settings and not self.config.algorithm.kl_in_reward:
            update = replace(update, kl_coef=settings["kl_coef"])
        self.adjusted |= settings
        self.parts = replace(parts, train_sampling=sampling, update_settings=update)

    def _validate(self, step: int) -> dict[str, float]:
        parts = self.parts
        sampling = replace(parts.train_sampling, seed=validation_seed(self.config.trainer.seed))
        metrics = validate(
            parts.val_engine,
            parts.scorer,
            parts.val_prompts,
            parts.prompt_ids,
            parts.rendered,
            sampling,
            self.config.rollout.val_samples,
            on_event=lambda kind, **fields: self.logger.log_event(kind, step=step, **fields),
        )
        # What the engine saw while validating (speculation's acceptance and verdicts, which
        # carry over to training; timeouts; torchrun ranks; tool calls), under val/ names
        # (rollout/x as val/x, tool/x as val/tool_x).
        report, events = parts.val_engine.take_report()
        for kind, fields in events:
            self.logger.log_event(kind, step=step, during="validation", **fields)
        return metrics | {_val_name(name): value for name, value in report.items()}

    def train_step(self, step: int) -> dict[str, float]:
        """One step: a generated and scored batch (made now or ahead, by the schedule), its
        advantages, the update, and the new weights to the rollout engines."""
        started = time.perf_counter()
        got, stages = self.schedule.take(step)  # generate, score
        if got.kept:
            experience, prepared = self._advantages(got, self._policy_acts(step))
            stages |= prepared | self._update(step, experience)
        if self._policy_acts(step):
            self.parts.trainers.policy.advance_schedule()  # its schedule starts with it
        synced = time.perf_counter()
        stages |= self.schedule.publish(step)  # sync
        stages["timing_s/sync"] = time.perf_counter() - synced  # ~0: an engine on the module
        if self._heads_due is not None:  # a sharded policy's MTP heads
            stages |= self._train_heads()
        trainers, system = self.parts.trainers, self.config.monitor.system_metrics
        if self.parts.source.solve_rates is not None:  # what the skip rules passed over
            stages |= self.parts.source.solve_rates.take_metrics()
        metrics = step_metrics(step, got, stages, started, trainers, system)
        self._record(step, got, metrics)
        return metrics

    def step_alone(self, step: int) -> dict[str, float]:
        """One step outside ``run`` (``honing doctor``): its batch made inline, whatever
        ``schedule.mode`` says."""
        self.schedule = Inline(self.config, self.parts, self.peers, self.offload, self._seed_of)
        try:
            return self.train_step(step)
        finally:
            self.schedule = None

    def _seed_of(self, step: int) -> int:
        """Step ``step``'s seed: its sampling and its mini-batches' shuffle."""
        return step_seed(self.config.trainer.seed, step)

    def _policy_acts(self, step: int) -> bool:
        """Whether the policy updates at ``step``: PPO's critic fits the values first, and
        during its warm-up the policy waits (its learning-rate schedule too)."""
        critic = self.parts.trainers.critic
        return critic is None or step > self.config.trainer.critic_warmup_steps

    def _advantages(self, got: Collected, acts: bool) -> tuple[Experience, dict[str, float]]:
        """The kept samples' experience (the passes without gradient, the advantages) and the
        time it took; the trainer's offloaded state back on its device first. ``acts``: the
        policy updates on it."""
        reloaded = self.offload.before_update()
        self.offload.mark()
        started = time.perf_counter()
        rollouts, rewards = [r for r, _ in got.kept], [s.reward for _, s in got.kept]
        parts = self.parts
        experience = make_experience(
            self.config, parts, rollouts, rewards, got.baselines, self.peers, acts
        )
        return experience, reloaded | {"timing_s/prepare": time.perf_counter() - started}

    def _update(self, step: int, experience: Experience) -> dict[str, float]:
        """The critic's fit and the policy's update on ``experience`` (every torchrun rank
        alongside), then the MTP heads' step on the updated policy."""
        trainers = self.parts.trainers
        started = time.perf_counter()
        acts = self._policy_acts(step)
        inputs = UpdateInputs(
            batch=experience.batch,
            advantages=experience.advantages,
            old_logprobs=experience.old_logprobs,
            ref_logprobs=experience.ref_logprobs,
            old_values=experience.old_values,
            returns=experience.returns,
            settings=replace(self.parts.update_settings, gap=experience.gap_in_update),
            seed=self._seed_of(step),
            act=acts,
            value_clip=self.config.algorithm.value_clip,
            lr=trainers.policy.learning_rates(),
        )
        with self.peers.together(Op.UPDATE, inputs):  # the other ranks run theirs alongside
            metrics = experience.metrics | apply_update(trainers, inputs)
        metrics["timing_s/update"] = time.perf_counter() - started
        if not acts:
            return metrics
        metrics["actor/lr"] = trainers.policy.learning_rates()[0]
        if trainers.mtp is not None:  # the draft heads learn the updated policy's hidden states
            self._heads_due = (experience.batch, inputs.seed)
            if not trainers.policy.is_sharded:  # else from rank 0's copy, once it has them
                metrics |= self._train_heads()
        return metrics | self.offload.peak("update")

    def _train_heads(self) -> dict[str, float]:
        """The MTP heads' step on the batch just trained, from the updated policy's hidden
        states: the policy's own, or under a sharded layout (whose passes need every rank)
        rank 0's whole generation copy after the step's weights reached it."""
        batch, seed = self._heads_due
        self._heads_due = None
        trainers, generator = self.parts.trainers, torch.Generator().manual_seed(seed)
        policy = trainers.policy
        module = policy.generation_module if policy.is_sharded else policy.module
        return train_mtp(trainers.mtp, module, batch, generator)

    def _record(self, step: int, got: Collected, metrics: dict[str, float]) -> None:
        """What the step says besides its metrics: the engine's events, steps and updates it
        skipped, a short batch, the samples and the histograms."""
        for kind, fields in got.engine_events:
            self.logger.log_event(kind, step=step, **fields)
        if not got.kept:
            self.logger.log_event("skipped_step", step=step, reason="no usable group to train on")
        batch_size = self.config.rollout.batch_size
        if got.rounds > 1 and len({r.group_index for r, _ in got.kept}) < batch_size:
            self.logger.log_event(
                "short_batch",
                step=step,
                rounds=got.rounds,
                reason="dynamic sampling ran out of generation rounds",
            )
        if metrics.get("actor/skipped_updates"):
            self.logger.log_event(
                "skipped_update",
                step=step,
                count=metrics["actor/skipped_updates"],
                reason="non-finite gradient norm",
            )
        self._log_samples(step, got.rollouts, got.scores)
        if self.config.monitor.histograms:
            rewards = [s.reward for _, s in got.kept]
            lengths = [len(r.response_ids) for r in got.rollouts]
            self.logger.log_histograms(step, {"critic/score": rewards, "response_length": lengths})

    def _log_samples(self, step: int, rollouts: list[Rollout], scores: list[Score]) -> None:
        count = self.config.monitor.log_samples
        if not count:
            return
        stride = max(1, len(rollouts) // count)
        picked = list(range(0, len(rollouts), stride))[:count]
        self.logger.log_samples(
            step,
            [
                {
                    "prompt": self.parts.rendered[rollouts[i].prompt_id],
                    "response": rollouts[i].text,
                    "reward": scores[i].reward,
                    "finish_reason": rollouts[i].finish_reason,
                    "response_length": len(rollouts[i].response_ids),
                    **tool_record(rollouts[i], self.parts.tokenizer),
                    **{
                        k: v
                        for k, v in scores[i].details.items()
                        if k
                        in (
                            "extracted",
                            "verdict",
                            "reason",
                            "error",
                            "overlong_penalty",
                            "tool_penalty",
                        )
                    },
                }
                for i in picked
            ],
        )


def _val_name(name: str) -> str:
    """An engine metric's name when it was measured while validating."""
    family, rest = name.split("/", 1)
    return f"val/{rest}" if family == "rollout" else f"val/{family}_{rest}"
