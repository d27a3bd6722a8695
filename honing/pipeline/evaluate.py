"""Validation on held-out prompts: greedy accuracy and pass@k.

A response counts as correct when the reward function's own score (the format bonus left
out) is at least 1.0, the verdict of a rule verifier. ``val/pass@k`` is the fraction of prompts
with at least one correct answer among k samples at the training temperature: the ceiling
that sharpening the policy's own samples can reach.
"""

from __future__ import annotations

import dataclasses
import time

from honing.rewards import Scorer
from honing.rollout.base import GenerationRequest, RolloutEngine, SamplingParams
from honing.types import Prompt, Rollout


def _correct(
    scorer: Scorer, prompts: dict[str, Prompt], rollouts: list[Rollout], rendered: dict[str, str]
) -> list[bool]:
    scores = scorer.score(prompts, rollouts, rendered)
    return [s.ok and s.details.get("base_score", s.reward) >= 1.0 for s in scores]


def validate(
    engine: RolloutEngine,
    scorer: Scorer,
    prompts: list[Prompt],
    prompt_ids: dict[str, list[int]],
    rendered: dict[str, str],
    sampling: SamplingParams,
    k: int,
) -> dict[str, float]:
    """``val/accuracy`` (greedy), ``val/pass@k`` and ``val/mean@k`` over ``prompts``."""
    started = time.perf_counter()
    by_id = {p.id: p for p in prompts}
    requests = [GenerationRequest(p.id, prompt_ids[p.id], i) for i, p in enumerate(prompts)]
    greedy = engine.generate(requests, dataclasses.replace(sampling, n=1, greedy=True))
    accuracy = _correct(scorer, by_id, greedy, rendered)
    sampled = engine.generate(requests, dataclasses.replace(sampling, n=k, greedy=False))
    correct = _correct(scorer, by_id, sampled, rendered)
    per_prompt = [correct[i * k : (i + 1) * k] for i in range(len(prompts))]
    return {
        "val/accuracy": sum(accuracy) / len(prompts),
        f"val/pass@{k}": sum(any(c) for c in per_prompt) / len(prompts),
        f"val/mean@{k}": sum(correct) / len(correct),
        "timing_s/val": time.perf_counter() - started,
    }
