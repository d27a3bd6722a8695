"""Score rollouts with a reward function, under an explicit policy for failures.

A failed score is never silently 0 (DESIGN.md): when the reward function raises, or returns
something that is not a finite number, ``on_error`` decides what happens and the reason is
kept in ``Score.details["error"]`` with ``ok=False``:

- ``"error"``: raise ``RewardError`` naming the function, the prompt and the exception;
- ``"zero"``: reward 0.0 (the sample still trains, as a failure);
- ``"drop"``: reward NaN; the caller filters ``ok=False`` samples out of the batch.

Reward functions run in this process, one call at a time; sandboxing and remote verifiers
(with timeouts) are reward functions of their own.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from typing import Any

from honing.errors import RewardError
from honing.rewards.registry import describe_error
from honing.types import Prompt, Rollout, Score

ON_ERROR_POLICIES = ("error", "zero", "drop")


class _ScoreFailure(Exception):
    """One reward call failed; the message is one line and names the function."""


class Scorer:
    """Turns rollouts into ``Score``s with a reward function and an optional format bonus.

    Args:
        reward_fn: a reward function (see ``honing.rewards.registry`` for the signature).
        format_fn: an optional second function whose score is added with ``format_weight``.
        format_weight: ``reward = score + format_weight * format_score``.
        on_error: ``"error"``, ``"zero"`` or ``"drop"`` (module docstring).

    Attributes:
        last_latencies_ms: wall time of each rollout's reward call(s) in the last ``score``.
    """

    def __init__(
        self,
        reward_fn: Callable[..., Any],
        *,
        format_fn: Callable[..., Any] | None = None,
        format_weight: float = 0.0,
        on_error: str = "error",
    ) -> None:
        if on_error not in ON_ERROR_POLICIES:
            raise RewardError(
                f"reward.on_error must be one of {', '.join(ON_ERROR_POLICIES)}; got {on_error!r}"
            )
        self.reward_fn = reward_fn
        self.format_fn = format_fn
        self.format_weight = format_weight
        self.on_error = on_error
        self.last_latencies_ms: list[float] = []

    def score(
        self,
        prompts_by_id: dict[str, Prompt],
        rollouts: list[Rollout],
        rendered_prompts: dict[str, str] | None = None,
    ) -> list[Score]:
        """One ``Score`` per rollout, in order.

        Args:
            prompts_by_id: the prompts the rollouts answer, by ``Prompt.id``.
            rollouts: completions to score.
            rendered_prompts: the model's prompt text by id, passed as ``prompt=``; without
                it the raw prompt text (message contents joined by newlines) is passed.

        Raises:
            RewardError: a reward call failed and ``on_error == "error"``.
            KeyError: a rollout's ``prompt_id`` is not in ``prompts_by_id`` (a caller bug).
        """
        rendered_prompts = rendered_prompts or {}
        self.last_latencies_ms = []
        scores = []
        for rollout in rollouts:
            prompt = prompts_by_id[rollout.prompt_id]
            start = time.perf_counter()
            try:
                scores.append(self._score_one(prompt, rollout, rendered_prompts.get(prompt.id)))
            except _ScoreFailure as failure:
                scores.append(self._failed(prompt, str(failure)))
            finally:
                self.last_latencies_ms.append((time.perf_counter() - start) * 1000.0)
        return scores

    def _score_one(self, prompt: Prompt, rollout: Rollout, rendered: str | None) -> Score:
        context = {
            "prompt": rendered if rendered is not None else _prompt_text(prompt),
            "data_source": prompt.data_source,
            "extra_info": prompt.extra_info,
        }
        reward, details = _call(self.reward_fn, rollout.text, prompt.ground_truth, context)
        if self.format_fn is not None:
            format_score, _ = _call(self.format_fn, rollout.text, prompt.ground_truth, context)
            details["format"] = format_score
            details["base_score"] = reward
            reward += self.format_weight * format_score
        return Score(reward=reward, ok=True, details=details)

    def _failed(self, prompt: Prompt, reason: str) -> Score:
        if self.on_error == "error":
            raise RewardError(
                f"{reason} (prompt {prompt.id}); fix the function, or set reward.on_error "
                "to 'zero' or 'drop' to record failures and continue"
            )
        reward = 0.0 if self.on_error == "zero" else math.nan
        return Score(reward=reward, ok=False, details={"error": reason})


def _call(
    fn: Callable[..., Any], response: str, ground_truth: Any, context: dict[str, Any]
) -> tuple[float, dict[str, Any]]:
    """Call one reward function and normalise its result to ``(score, details)``.

    Raises:
        _ScoreFailure: the function raised, or returned no finite number.
    """
    name = _function_name(fn)
    try:
        result = fn(response, ground_truth, **context)
    except Exception as exc:  # noqa: BLE001 - user reward code may raise anything
        raise _ScoreFailure(f"reward function {name} raised {describe_error(exc)}") from None
    details: dict[str, Any] = {}
    value = result
    if isinstance(result, Mapping):
        if "score" not in result:
            raise _ScoreFailure(
                f"reward function {name} returned a dict without 'score' "
                f"(keys: {', '.join(map(str, result))}); expected a float 'score'"
            )
        value = result["score"]
        details = {key: item for key, item in result.items() if key != "score"}
    try:
        if isinstance(value, (str, bytes)):
            raise TypeError
        score = float(value)
    except (TypeError, ValueError):
        raise _ScoreFailure(
            f"reward function {name} returned {_short_repr(value)}; expected a float "
            "or a dict with a float 'score'"
        ) from None
    if not math.isfinite(score):
        raise _ScoreFailure(f"reward function {name} returned {score}; expected a finite float")
    return score, details


def _prompt_text(prompt: Prompt) -> str:
    """The unrendered prompt: the string itself, or message contents one per line."""
    if isinstance(prompt.prompt, str):
        return prompt.prompt
    return "\n".join(message["content"] for message in prompt.prompt)


def _function_name(fn: Callable[..., Any]) -> str:
    module = getattr(fn, "__module__", None)
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    return f"{module}.{name}" if module else name


def _short_repr(value: Any) -> str:
    text = " ".join(repr(value).split())
    return f"{type(value).__name__} {text[:60]}"
