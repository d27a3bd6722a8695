"""Validation on held-out prompts: greedy accuracy and pass@k.

A response counts as correct when the reward function's own score (the format bonus left
out) is at least 1.0, the verdict of a rule verifier. ``val/pass@k`` is the fraction of prompts
with at least one correct answer among k samples at the training temperature: the ceiling
that sharpening the policy's own samples can reach.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

from honing.checkpoint.manifest import MANIFEST, verify
from honing.config import Config
from honing.data.solve_rates import is_solved
from honing.errors import ConfigError
from honing.models.loading import (
    check_model_dir,
    load_causal_lm,
    load_tokenizer,
    peft_quietly,
    resolve_device,
)
from honing.pipeline.components import resolve_model_path
from honing.pipeline.inputs import (
    build_scorer,
    check_ground_truths,
    keep_tokenized,
    load_datasets,
    tokenize_prompts,
)
from honing.pipeline.rollout_engines import local_engine, train_sampling
from honing.pipeline.rules import check_config
from honing.rewards import Scorer
from honing.rollout.base import GenerationRequest, RolloutEngine, SamplingParams
from honing.seeds import validation_seed
from honing.types import Prompt, Rollout

RESCORE_WAITS_S = (1.0, 2.0)  # pauses before each further try of the failed scores


def _correct(
    scorer: Scorer,
    prompts: dict[str, Prompt],
    rollouts: list[Rollout],
    rendered: dict[str, str],
    failures: dict[str, int | str],
) -> list[bool | None]:
    """Per rollout: whether the answer is correct, or ``None`` when its score failed on
    every try. A failed score is tried again after each of ``RESCORE_WAITS_S`` (a busy or
    restarting service); what still fails is counted in ``failures`` (``count``,
    ``retried``, ``reason``), or raised under ``reward.on_error=fail``, as in training."""
    scores = scorer.score(prompts, rollouts, rendered, on_error="drop")
    for wait in RESCORE_WAITS_S:
        failed = [i for i, s in enumerate(scores) if not s.ok]
        if not failed:
            break
        failures["retried"] = failures.get("retried", 0) + len(failed)
        time.sleep(wait)
        again = scorer.score(prompts, [rollouts[i] for i in failed], rendered, on_error="drop")
        for index, score in zip(failed, again, strict=True):
            scores[index] = score
    failed = [i for i, s in enumerate(scores) if not s.ok]
    if failed:
        reason = str(scores[failed[0]].details.get("error"))
        if scorer.on_error == "fail":
            raise scorer.failure(rollouts[failed[0]].prompt_id, reason)
        failures["count"] = failures.get("count", 0) + len(failed)
        failures.setdefault("reason", reason)
    return [is_solved(s) for s in scores]


def _share(hits: int, known: int) -> float:
    return hits / known if known else float("nan")


def validate(
    engine: RolloutEngine,
    scorer: Scorer,
    prompts: list[Prompt],
    prompt_ids: dict[str, list[int]],
    rendered: dict[str, str],
    sampling: SamplingParams,
    k: int,
    on_event: Callable[..., None] | None = None,
) -> dict[str, float]:
    """``val/accuracy`` (greedy), ``val/pass@k`` and ``val/mean@k`` over ``prompts``.

    A score that still fails after its retries is left out of the denominators (a prompt
    counts for pass@k when one of its answers is correct or all of them were scored) and
    counted in ``val/score_errors`` (``val/score_retried``: the scores tried again);
    ``on_event("val_score_errors", ...)`` then says how many
    and why. When nothing could be scored the rates are NaN."""
    started = time.perf_counter()
    by_id = {p.id: p for p in prompts}
    failures: dict[str, int | str] = {}
    requests = [GenerationRequest(p.id, prompt_ids[p.id], i) for i, p in enumerate(prompts)]
    greedy = engine.generate(requests, dataclasses.replace(sampling, n=1, greedy=True))
    accuracy = _correct(scorer, by_id, greedy, rendered, failures)
    sampled = engine.generate(requests, dataclasses.replace(sampling, n=k, greedy=False))
    correct = _correct(scorer, by_id, sampled, rendered, failures)
    per_prompt = [correct[i * k : (i + 1) * k] for i in range(len(prompts))]
    passed = [any(c) or (None if None in c else False) for c in per_prompt]
    count = int(failures.get("count", 0))
    if count and on_event is not None:
        on_event(
            "val_score_errors",
            count=count,
            scored=len(greedy) + len(sampled) - count,
            retried=failures.get("retried", 0),
            reason=failures["reason"],
        )
    return {
        "val/accuracy": _share(
            sum(c is True for c in accuracy), sum(c is not None for c in accuracy)
        ),
        f"val/pass@{k}": _share(sum(p is True for p in passed), sum(p is not None for p in passed)),
        f"val/mean@{k}": _share(
            sum(c is True for c in correct), sum(c is not None for c in correct)
        ),
        "val/score_errors": float(count),
        "val/score_retried": float(failures.get("retried", 0)),
        "timing_s/val": time.perf_counter() - started,
    }


def evaluate_model(config: Config, model_path: str, log=print) -> dict[str, float]:
    """``honing eval``: the validation metrics of the model at ``model_path`` on the config's
    validation prompts, sampled exactly as a run validates (same seed and settings), so a
    checkpoint scores what its run logged at that step.

    ``model_path``: a Hugging Face model directory, a run's checkpoint (``step_N``, the policy
    in Hugging Face format), or a LoRA run's checkpoint (the adapter, loaded onto the config's
    ``model.path`` as base + adapter).
    """
    check_config(config)
    path, m = Path(model_path), config.model

    def say(kind: str, **fields) -> None:  # an event, as one console line
        log(f"honing: {kind}: " + " ".join(f"{k}={v}" for k, v in fields.items()))

    check_files(path, log)
    device = resolve_device(m.device)
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
        rendered, prompt_ids = tokenize_prompts(
            val, tokenizer, config.rollout.max_seq_len, config.data.on_bad_row
        )
        _, val, skipped = keep_tokenized([], val, 0, prompt_ids)  # too long, under skip
        if skipped:
            say("skipped_rows", count=skipped, reason="at least rollout.max_seq_len tokens")
        engine = local_engine(config, model, tokenizer, device)
        sampling = dataclasses.replace(
            train_sampling(config), seed=validation_seed(config.trainer.seed)
        )  # as the run validates (TrainLoop._validate)
        metrics = validate(
            engine,
            scorer,
            val,
            prompt_ids,
            rendered,
            sampling,
            config.rollout.val_samples,
            on_event=say,
        )
    finally:
        scorer.close()
    return metrics | {"val/prompts": float(len(val))}


def check_files(path: Path, log) -> None:
    """A checkpoint's files must match its manifest (as ``--resume`` checks); a directory
    without one (a plain model directory) is loaded as it is, and said so."""
    if not path.is_dir():
        raise ConfigError(f"--model {path}: no such directory")
    if not (path / MANIFEST).exists():
        log(f"note: {path} has no {MANIFEST} (not a honing checkpoint): its files are not checked")
        return
    problem = verify(path)
    if problem is not None:
        raise ConfigError(
            f"--model {path}: the checkpoint is damaged ({problem}); evaluate another one "
            "(honing checkpoints RUN_DIR lists them with their health)"
        )
