"""A training step's metrics, from what its stages produced: the samples' accounting, lengths
and scores, timings and throughput, and how the trained modules are laid out
(docs/monitoring.md names them all; ``monitor/names.py`` lists them)."""

from __future__ import annotations

import statistics
import time

from honing.monitor.logger import distribution_metrics
from honing.monitor.system import system_metrics
from honing.pipeline.collect import Collected
from honing.pipeline.components import Trainers

ACCOUNTED = ("samples/trained", "samples/filtered", "samples/failed", "samples/stale")


def step_metrics(
    step: int,
    got: Collected,
    stages: dict[str, float],
    started: float,
    trainers: Trainers,
    system: bool = False,
) -> dict[str, float]:
    """The step's metrics: ``stages``' own (the schedule's, the update's, the sync's) with the
    batch's, the timings and throughput since ``started`` (``time.perf_counter``), the
    layout's and (``system``) the host's.

    Raises:
        RuntimeError: docs/design.md's invariant broke: a generated sample is not trained,
            filtered, failed or stale.
    """
    metrics = rollout_metrics(got) | stages | got.engine_metrics  # speculation, Ray workers
    metrics.setdefault("samples/stale", 0)
    metrics.setdefault("samples/trained", 0)
    metrics["samples/filtered"] += metrics.get("samples/filtered_truncated", 0)
    check_accounting(step, metrics)
    metrics |= throughput(got, metrics, time.perf_counter() - started)
    rewards = [s.reward for _, s in got.kept]
    lengths = [len(r.response_ids) for r in got.rollouts]
    spread = distribution_metrics("response_length", lengths)
    spread |= distribution_metrics("critic/score", rewards)
    metrics = spread | metrics  # the batch's own min/max/mean stay as they are
    if system:
        metrics |= system_metrics()
    return metrics | layout_metrics(trainers)


def rollout_metrics(got: Collected) -> dict[str, float]:
    """The batch's lengths, accounting, scores and reward latencies."""
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


def check_accounting(step: int, metrics: dict) -> None:
    """docs/design.md's invariant: generated = trained + filtered + failed + stale."""
    if metrics["samples/generated"] != sum(metrics[k] for k in ACCOUNTED):
        raise RuntimeError(
            f"sample accounting broken at step {step}: "
            f"{ {k: v for k, v in metrics.items() if 'samples/' in k} }"
        )


def throughput(got: Collected, metrics: dict, seconds: float) -> dict[str, float]:
    """Generation and scoring times, the step's time, and tokens per second: of the whole
    step, of generation (sampled tokens) and of the update (trained tokens)."""
    generated = sum(len(r.response_ids) for r in got.rollouts)
    tokens = generated + sum(len(r.prompt_ids) for r in got.rollouts)
    out = {
        "timing_s/gen": got.gen_seconds,
        "timing_s/reward": got.reward_seconds,
        "timing_s/step": seconds,
        "perf/throughput": tokens / seconds,
    }
    if got.gen_seconds > 0:
        out["perf/gen_tokens_per_s"] = generated / got.gen_seconds
    if metrics.get("timing_s/update"):
        trained = sum(len(r.prompt_ids) + len(r.response_ids) for r, _ in got.kept)
        out["perf/train_tokens_per_s"] = trained / metrics["timing_s/update"]
    return out


def layout_metrics(trainers: Trainers) -> dict[str, float]:
    """``dist/world_size``, ``dist/strategy`` (0: one process, 1: replicated ranks, 2:
    sharded) and ``memory/model_state_mb``: the parameters, gradients and optimizer state
    this process holds, what sharding divides; under expert parallelism the policy's
    ``expert_metrics``."""
    policy = trainers.policy
    strategy = 2.0 if policy.is_sharded else (1.0 if policy.world_size > 1 else 0.0)
    held = sum(trainer.state_bytes() for trainer in trainers.all())
    return {
        "dist/world_size": float(policy.world_size),
        "dist/strategy": strategy,
        "memory/model_state_mb": held / 2**20,
    } | policy.expert_metrics()
