"""Collect one step's training groups: generate, score, shape, and filter.

With DAPO's dynamic sampling (https://arxiv.org/abs/2503.14476, section 3.2) a group whose
rewards are all equal has zero advantage under group baselines and teaches nothing: it is
dropped and more prompts are generated, until ``batch_size`` groups are kept or
``max_gen_rounds`` rounds have run (then the step trains on the groups it has, and says so).

Every generated sample ends up in exactly one of: kept (trained), filtered (with a reason:
``uniform_group``), failed (its score failed and ``reward.on_error=drop``).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field, replace

from honing.config import Config
from honing.data.solve_rates import is_solved
from honing.pipeline.components import Components
from honing.rewards.shaping import overlong_penalty, tool_penalty
from honing.rollout.base import GenerationRequest
from honing.seeds import round_seed
from honing.types import Rollout, Score


@dataclass
class Collected:
    """All rollouts of the step (for metrics and samples) and the ones to train on."""

    rollouts: list[Rollout] = field(default_factory=list)
    scores: list[Score] = field(default_factory=list)
    kept: list[tuple[Rollout, Score]] = field(default_factory=list)
    failed: int = 0
    filtered: Counter = field(default_factory=Counter)  # reason -> samples
    rounds: int = 0
    gen_seconds: float = 0.0
    reward_seconds: float = 0.0
    latencies_ms: list[float] = field(default_factory=list)
    reward_counters: Counter = field(default_factory=Counter)  # client: errors, retries, ...
    baselines: dict[int, float] = field(default_factory=dict)  # remax: greedy score by group
    groups_kept: int = 0
    regenerated: int = 0
    engine_metrics: dict = field(default_factory=dict)  # what the engine reports (gauges)
    engine_events: list = field(default_factory=list)  # (kind, fields) the engine reports


def _is_uniform(scores: list[Score]) -> bool:
    rewards = [s.reward for s in scores]
    return max(rewards) - min(rewards) < 1e-9


def collect(config: Config, parts: Components, step: int, seed: int) -> Collected:
    """Generate and score groups for ``step``; ``seed`` seeds round 0 (round r: seed + r)."""
    algo, rollout = config.algorithm, config.rollout
    out = Collected()
    rounds = algo.max_gen_rounds if algo.dynamic_sampling else 1
    while out.rounds < rounds and out.groups_kept < rollout.batch_size:
        prompts = parts.source.next_batch()
        generated = generate_round(parts, prompts, out.rounds, seed)
        score_round(config, parts, generated, out)
    return out


@dataclass
class Generated:
    """One round's prompts and their sampled completions, not yet scored."""

    prompts: list
    requests: list[GenerationRequest]
    rollouts: list[Rollout]
    seconds: float
    regenerated: int = 0  # samples lost with a failed engine and generated again elsewhere
    report: tuple = ({}, [])  # the engine's metrics and events for this round


def generate_round(parts: Components, prompts: list, round_index: int, seed: int) -> Generated:
    """Sample ``group_size`` completions of each prompt (group ids unique across rounds)."""
    base = round_index * len(prompts)
    requests = [
        GenerationRequest(p.id, parts.prompt_ids[p.id], base + i) for i, p in enumerate(prompts)
    ]
    t0 = time.perf_counter()
    engine = parts.engine
    lost_before = engine.regenerated  # samples of failed remote requests and dead workers
    sampling = replace(parts.train_sampling, seed=round_seed(seed, round_index))
    rollouts = engine.generate(requests, sampling)
    regenerated = engine.regenerated - lost_before
    seconds = time.perf_counter() - t0
    report = engine.take_report()  # speculation, timeouts, Ray workers
    return Generated(prompts, requests, rollouts, seconds, regenerated, report)


def score_round(config: Config, parts: Components, generated: Generated, out: Collected) -> None:
    """Score one round's rollouts, shape the rewards, and file every sample into ``out`` as
    kept, filtered or failed."""
    algo, rollout = config.algorithm, config.rollout
    prompts, rollouts = generated.prompts, generated.rollouts
    t1 = time.perf_counter()
    scores = parts.scorer.score({p.id: p for p in prompts}, rollouts, parts.rendered)
    out.latencies_ms += parts.scorer.last_latencies_ms
    out.reward_counters.update(parts.scorer.last_metrics)
    out.reward_seconds += time.perf_counter() - t1
    out.gen_seconds += generated.seconds
    out.regenerated += generated.regenerated
    out.engine_metrics |= generated.report[0]
    out.engine_events += generated.report[1]
    out.rounds += 1
    _observe(parts, rollouts, scores)  # the raw verdicts, before shaping
    _shape(config, rollouts, scores)
    if algo.advantage == "remax":
        out.baselines |= _greedy_baselines(
            parts, generated.requests, prompts, rollout.max_new_tokens
        )
    out.rollouts += rollouts
    out.scores += scores
    for group in _groups(rollouts, scores):
        usable = [(r, s) for r, s in group if math.isfinite(s.reward)]
        out.failed += len(group) - len(usable)
        if algo.dynamic_sampling and (
            out.groups_kept >= rollout.batch_size
            or (usable and _is_uniform([s for _, s in usable]))
        ):
            out.filtered[
                "uniform_group" if out.groups_kept < rollout.batch_size else "batch_full"
            ] += len(usable)
            continue
        out.kept += usable
        out.groups_kept += bool(usable)


def _groups(rollouts: list[Rollout], scores: list[Score]):
    by_group: dict[int, list] = {}
    for r, s in zip(rollouts, scores, strict=True):
        by_group.setdefault(r.group_index, []).append((r, s))
    return by_group.values()


def _observe(parts: Components, rollouts: list[Rollout], scores: list[Score]) -> None:
    """Each group's verdicts into its prompt's solve rate (under a skip rule)."""
    rates = parts.source.solve_rates
    if rates is None:
        return
    for group in _groups(rollouts, scores):
        rates.observe(group[0][0].prompt_id, [is_solved(s) for _, s in group])


def _shape(config: Config, rollouts: list[Rollout], scores: list[Score]) -> None:
    """Add DAPO's overlong penalty and the tool calls' penalty to each finite reward (each
    recorded in the details)."""
    reward = config.reward
    if reward.tool_error_penalty or reward.tool_call_penalty:
        for r, s in zip(rollouts, scores, strict=True):
            penalty = tool_penalty(
                r.tool_calls,
                reward.tool_error_penalty,
                reward.tool_call_penalty,
                reward.free_tool_calls,
            )
            if penalty and math.isfinite(s.reward):
                s.reward += penalty
                s.details["tool_penalty"] = penalty
    if reward.overlong_buffer_len <= 0:
        return
    for r, s in zip(rollouts, scores, strict=True):
        penalty = overlong_penalty(
            len(r.response_ids),
            config.rollout.max_new_tokens,
            reward.overlong_buffer_len,
            reward.overlong_penalty_factor,
        )
        if penalty and math.isfinite(s.reward):
            s.reward += penalty
            s.details["overlong_penalty"] = penalty


def _greedy_baselines(parts: Components, requests, prompts, max_new_tokens: int) -> dict:
    """ReMax's baseline (https://arxiv.org/abs/2310.10505): the reward of the greedy answer to
    each prompt. These rollouts only set baselines; they are not trained on or counted."""
    greedy = parts.engine.generate(requests, replace(parts.train_sampling, n=1, greedy=True))
    scores = parts.scorer.score({p.id: p for p in prompts}, greedy, parts.rendered)
    return {r.group_index: s.reward for r, s in zip(greedy, scores, strict=True)}
