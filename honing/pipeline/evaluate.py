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


def evaluate_model(config, model_path: str, log=print) -> dict[str, float]:
    """``honing eval``: the validation metrics of the model at ``model_path`` on the config's
    validation prompts, sampled exactly as a run validates (same seed and settings), so a
    checkpoint scores what its run logged at that step.

    ``model_path``: a Hugging Face model directory, a run's checkpoint (``step_N``, the policy
    in Hugging Face format), or a LoRA run's checkpoint (the adapter, loaded onto the config's
    ``model.path`` as base + adapter).
    """
    from pathlib import Path

    from honing.errors import ConfigError
    from honing.models.loading import (
        check_model_dir,
        load_causal_lm,
        load_tokenizer,
        peft_quietly,
    )
    from honing.models.loading import resolve_device as device_of
    from honing.pipeline.components import (
        build_scorer,
        check_ground_truths,
        load_datasets,
        local_engine,
        resolve_model_path,
        tokenize_prompts,
        train_sampling,
    )
    from honing.pipeline.loop import step_seed

    path, m = Path(model_path), config.model
    device = device_of(m.device)
    scorer = build_scorer(config)
    try:
        _, val, _ = load_datasets(config)
        check_ground_truths(val, scorer)
        if (path / "adapter_config.json").exists():  # a LoRA checkpoint: base + adapter
            try:
                from peft import PeftModel
            except ImportError:
                raise ConfigError(f"{path} is a LoRA adapter: pip install peft") from None
            tokenizer = load_tokenizer(path, trust_remote_code=m.trust_remote_code)
            base = load_causal_lm(
                resolve_model_path(config, log=log),
                tokenizer,
                dtype=m.dtype,
                device=device,
                trust_remote_code=m.trust_remote_code,
            )
            with peft_quietly():
                model = PeftModel.from_pretrained(base, path).eval()
        else:
            check_model_dir(path)
            tokenizer = load_tokenizer(path, trust_remote_code=m.trust_remote_code)
            model = load_causal_lm(
                path, tokenizer, dtype=m.dtype, device=device, trust_remote_code=m.trust_remote_code
            ).eval()
        rendered, prompt_ids = tokenize_prompts(val, tokenizer, config.rollout.max_seq_len)
        engine = local_engine(config, model, tokenizer, device)
        sampling = dataclasses.replace(
            train_sampling(config), seed=step_seed(config.trainer.seed, -1)
        )  # as the run validates (TrainLoop._validate)
        metrics = validate(
            engine, scorer, val, prompt_ids, rendered, sampling, config.rollout.val_samples
        )
    finally:
        scorer.close()
    return metrics | {"val/prompts": float(len(val))}
