"""The training loop: generate -> score -> update, under each schedule.

Per step: take a batch of prompts, sample ``group_size`` completions each, score them,
compute advantages, update the policy, log, and validate / checkpoint on schedule. Under
``schedule.mode=sync`` the batch is made right then, by the in-process engine that shares the
policy; under ``one_step`` / ``async`` it was made ahead by ``producer.RolloutProducer`` on
other threads (with its own copy of the policy, which gets each new version). Every generated
sample is accounted for: generated = trained + filtered + failed + stale, where failed counts
the samples whose score failed and were dropped (``reward.on_error=drop``) and stale those
that arrived staler than ``schedule.max_staleness``; ``samples/score_errors`` counts every
failed score, also those trained with a recorded 0 (``reward.on_error=zero``).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from honing.checkpoint import CheckpointManager
from honing.config import Config
from honing.errors import RunStopped
from honing.monitor import RunLogger
from honing.monitor.logger import distribution_metrics
from honing.monitor.system import system_metrics
from honing.pipeline.alerting import Alerting, Decision, set_aside_newer
from honing.pipeline.collect import Collected, collect
from honing.pipeline.components import Components
from honing.pipeline.evaluate import validate
from honing.pipeline.experience import make_experience
from honing.pipeline.offload import Offloader
from honing.pipeline.peers import Alone, Peers
from honing.pipeline.producer import RolloutProducer
from honing.pipeline.state import load_training_state, save_training_state
from honing.pipeline.update import UpdateInputs, apply_update
from honing.pipeline.weight_sync import send_weights, snapshot
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
        val_engine = engine if same else self.peers.spread(parts.val_engine)
        parts = replace(parts, engine=engine, val_engine=val_engine)
        self.parts = parts
        self.logger = logger
        self.checkpoints = checkpoints
        self.producer: RolloutProducer | None = None  # one_step / async: rollouts made ahead
        self.adjusted: dict[str, float] = {}  # alert rollbacks' temperature and kl_coef
        self.offload = Offloader(config.memory, config.schedule.mode, parts, logger.log_event)

    def run(self, start_step: int) -> None:
        cfg = self.config.trainer
        alerting = Alerting(self.config.monitor, self.logger, self.checkpoints.root.parent)
        step = start_step
        self._start_producer(start_step)
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
                self.logger.log_metrics(step, metrics)
                decision = alerting.after_step(step, metrics)
                if decision is not None:
                    step = self._act(decision, step, alerting)
                    continue
                every = self.config.checkpoint.every
                if last or (every and step % every == 0):
                    self._save(step)
        except KeyboardInterrupt:  # Ctrl-C, SIGTERM: uploads under way get a short while
            self._end(step, alerting, upload_wait_s=30.0)
            raise
        except BaseException:
            self._end(step, alerting)
            raise
        self._end(step, alerting)

    def _end(self, step: int, alerting: Alerting, upload_wait_s: float = 600.0) -> None:
        """The producer stopped, the mirror's queued uploads awaited, the alerts closed:
        each whatever the one before it raised."""
        try:
            self._stop_producer(step, "end of run")
        finally:
            try:
                self.checkpoints.finish_uploads(upload_wait_s)
            finally:
                alerting.close()

    def _start_producer(self, start_step: int) -> None:
        """Under ``one_step`` / ``async``, rollouts are produced ahead on other threads."""
        if self.config.schedule.mode == "sync":
            return
        seed = self.config.trainer.seed
        self.producer = RolloutProducer(
            self.config, self.parts, start_step, lambda step: step_seed(seed, step)
        )

    def _stop_producer(self, step: int, reason: str) -> None:
        """Stops the producer; samples made for later steps are discarded, and said so."""
        if self.producer is None:
            return
        discarded = self.producer.close()
        self.producer = None
        if discarded:
            self.logger.log_event("rollouts_discarded", step=step, samples=discarded, reason=reason)

    def _save(self, step: int, required: bool | None = None):
        source = self.producer.source_state(step + 1) if self.producer else None
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
        self._stop_producer(step, "rollback")
        target = self._rollback_to(target, changes)
        self._start_producer(target)
        alerting.engine.reset()
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
        sampling, update = parts.train_sampling, parts.update
        if "temperature" in settings:
            sampling = replace(sampling, temperature=settings["temperature"])
            update = replace(update, temperature=settings["temperature"])
        if "kl_coef" in settings and not self.config.algorithm.kl_in_reward:
            update = replace(update, kl_coef=settings["kl_coef"])
        self.adjusted |= settings
        self.parts = replace(parts, train_sampling=sampling, update=update)

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
        # carry over to training; timeouts; torchrun ranks), under val/ names.
        report, events = parts.val_engine.take_report()
        for kind, fields in events:
            self.logger.log_event(kind, step=step, during="validation", **fields)
        return metrics | {f"val/{name.split('/', 1)[1]}": value for name, value in report.items()}

    def train_step(self, step: int) -> dict[str, float]:
        parts, cfg = self.parts, self.config
        t0 = time.perf_counter()
        if self.producer is None:
            offloaded = self.offload.before_generation()
            self.offload.mark()
            got, schedule = collect(cfg, parts, step, step_seed(cfg.trainer.seed, step)), {}
            schedule |= offloaded | self.offload.peak("gen")
        else:
            got, schedule = self.producer.take(step)
        metrics = self._rollout_metrics(got) | schedule
        metrics |= got.engine_metrics  # speculation, Ray workers
        for kind, fields in got.engine_events:
            self.logger.log_event(kind, step=step, **fields)
        metrics.setdefault("samples/stale", 0)
        if got.kept:
            metrics |= self._update(step, got)
        else:
            metrics["samples/trained"] = 0
            self.logger.log_event("skipped_step", step=step, reason="no usable group to train on")
        if got.rounds > 1 and len({r.group_index for r, _ in got.kept}) < cfg.rollout.batch_size:
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
        metrics["samples/filtered"] += metrics.get("samples/filtered_truncated", 0)
        self._check_accounting(step, metrics)
        if parts.trainers.critic is None or step > cfg.trainer.critic_warmup_steps:
            parts.trainers.policy.advance_schedule()  # the policy's schedule starts with it
        t_sync = time.perf_counter()
        if self.producer is None:
            with self.peers.together("sync", step):
                metrics["perf/sync_mb"] = send_weights(parts, step) / 2**20
        else:  # the producer's engine gets them on its own thread
            parts.val_engine.load_weights(step)
            self.producer.publish(step, snapshot(parts, self.producer.engine))
        t_end = time.perf_counter()
        metrics["timing_s/sync"] = t_end - t_sync  # ~0 when the engine shares the module
        generated = sum(len(r.response_ids) for r in got.rollouts)
        tokens = generated + sum(len(r.prompt_ids) for r in got.rollouts)
        metrics |= {
            "timing_s/gen": got.gen_seconds,
            "timing_s/reward": got.reward_seconds,
            "timing_s/step": t_end - t0,
            "perf/throughput": tokens / (t_end - t0),
        }
        if got.gen_seconds > 0:  # sampled tokens per second of generation
            metrics["perf/gen_tokens_per_s"] = generated / got.gen_seconds
        if metrics.get("timing_s/update"):  # tokens through the update per second of it
            trained = sum(len(r.prompt_ids) + len(r.response_ids) for r, _ in got.kept)
            metrics["perf/train_tokens_per_s"] = trained / metrics["timing_s/update"]
        self._log_samples(step, got.rollouts, got.scores)
        rewards = [s.reward for _, s in got.kept]
        lengths = [len(r.response_ids) for r in got.rollouts]
        dist = distribution_metrics("response_length", lengths)
        dist |= distribution_metrics("critic/score", rewards)
        metrics = dist | metrics  # the loop's own min/max/mean stay as they are
        if cfg.monitor.histograms:
            self.logger.log_histograms(step, {"critic/score": rewards, "response_length": lengths})
        if cfg.monitor.system_metrics:
            metrics |= system_metrics()
        return metrics | self._layout_metrics()

    def _layout_metrics(self) -> dict[str, float]:
        """``dist/world_size``, ``dist/strategy`` (0: one process, 1: replicated ranks, 2:
        sharded) and ``memory/model_state_mb``: the parameters, gradients and optimizer
        state this process holds, what sharding divides."""
        policy = self.parts.trainers.policy
        strategy = 2.0 if policy.is_sharded else (1.0 if policy.world_size > 1 else 0.0)
        held = sum(engine.state_bytes() for engine in self.parts.trainers.all())
        return {
            "dist/world_size": float(policy.world_size),
            "dist/strategy": strategy,
            "memory/model_state_mb": held / 2**20,
        }

    @staticmethod
    def _check_accounting(step: int, metrics: dict) -> None:
        """docs/design.md's invariant: every generated sample is trained, filtered or failed."""
        parts = ("samples/trained", "samples/filtered", "samples/failed", "samples/stale")
        if metrics["samples/generated"] != sum(metrics[k] for k in parts):
            raise RuntimeError(
                f"sample accounting broken at step {step}: "
                f"{ {k: v for k, v in metrics.items() if 'samples/' in k} }"
            )

    def _update(self, step: int, got: Collected) -> dict:
        parts, trainers = self.parts, self.parts.trainers
        reloaded = self.offload.before_update()
        self.offload.mark()
        t0 = time.perf_counter()
        rollouts, rewards = [r for r, _ in got.kept], [s.reward for _, s in got.kept]
        exp = make_experience(self.config, parts, rollouts, rewards, got.baselines, self.peers)
        t_update = time.perf_counter()
        # PPO's critic fits the values first; during its warm-up the policy waits.
        act = trainers.critic is None or step > self.config.trainer.critic_warmup_steps
        inputs = UpdateInputs(
            batch=exp.batch,
            advantages=exp.advantages,
            old_logprobs=exp.old_logprobs,
            ref_logprobs=exp.ref_logprobs,
            old_values=exp.old_values,
            returns=exp.returns,
            settings=parts.update,
            seed=step_seed(self.config.trainer.seed, step),
            act=act,
            value_clip=self.config.algorithm.value_clip,
            lr=trainers.policy.learning_rates(),
        )
        with self.peers.together("update", inputs):  # the other ranks run theirs alongside
            metrics = exp.metrics | apply_update(trainers, inputs)
        metrics["timing_s/update"] = time.perf_counter() - t_update
        if not act:
            return metrics | reloaded
        metrics["actor/lr"] = trainers.policy.learning_rates()[0]
        if trainers.mtp is not None:  # the draft heads learn the updated policy's hidden states
            generator = torch.Generator().manual_seed(inputs.seed)
            metrics |= train_mtp(trainers.mtp, parts.policy, exp.batch, generator)
        metrics["timing_s/prepare"] = t_update - t0
        return metrics | reloaded | self.offload.peak("update")

    def _rollout_metrics(self, got: Collected) -> dict:
        rollouts, scores = got.rollouts, got.scores
        rewards = [s.reward for _, s in got.kept]  # what is trained
        lengths = [len(r.response_ids) for r in rollouts]
        latencies = sorted(got.latencies_ms)
        metrics = {
            "response_length/mean": statistics.fmean(lengths),
            "response_length/max": max(lengths),
            "response_length/clip_ratio": sum(r.finish_reason == "length" for r in rollouts)
            / len(rollouts),
            "samples/generated": len(rollouts),
            "samples/failed": got.failed,
            "samples/filtered": sum(got.filtered.values()),
            "samples/score_errors": sum(not s.ok for s in scores),
            "samples/gen_rounds": got.rounds,
            "samples/regenerated": got.regenerated,
            "reward/latency_p50_ms": latencies[(len(latencies) - 1) // 2],
            "reward/latency_p99_ms": latencies[int(0.99 * (len(latencies) - 1))],
            **got.reward_counters,
        }
        metrics |= {f"samples/filtered_{reason}": n for reason, n in got.filtered.items()}
        if rewards:
            metrics |= {
                "critic/score/mean": statistics.fmean(rewards),
                "critic/score/max": max(rewards),
                "critic/score/min": min(rewards),
                "critic/score/std": statistics.pstdev(rewards),
            }
        return metrics

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
                    **{
                        k: v
                        for k, v in scores[i].details.items()
                        if k in ("extracted", "verdict", "reason", "error", "overlong_penalty")
                    },
                }
                for i in picked
            ],
        )
