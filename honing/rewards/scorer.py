"""Score rollouts with reward functions, under an explicit policy for failures.

A failed score is never silently 0 (docs/design.md): when a reward function raises, or returns
something that is not a finite number, ``on_error`` decides what happens and the reason is
kept in ``Score.details["error"]`` with ``ok=False``:

- ``"fail"``: raise ``RewardError`` naming the function, the prompt and
  the exception;
- ``"zero"``: reward 0.0 (the sample still trains, as a failure);
- ``"drop"``: reward NaN; the caller filters ``ok=False`` samples out of the batch.

A reward function is called once per rollout, unless it offers
``score_batch(items) -> list`` (``BatchRewardFn``): then the whole batch goes to it in one
call, which is where verifier pools, sandboxes and HTTP clients get their parallelism. Each
item is ``{"response", "ground_truth", "data_source", "extra_info", "prompt"}``; each result
is what a plain call would return, or an ``Exception`` for an item that failed.

The reward is ``main + sum(weight * component)`` over the weighted components (the format
bonus is one); the main score is kept as ``details["base_score"]`` and each component's
score under its name.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from honing.errors import RewardError
from honing.rewards.registry import describe_error
from honing.types import Prompt, Rollout, Score

ON_ERROR_POLICIES = ("fail", "zero", "drop")


@runtime_checkable
class BatchRewardFn(Protocol):
    """A reward function that scores a whole batch at once (see the module docstring)."""

    def score_batch(self, items: list[dict[str, Any]]) -> list[Any]: ...


class _ScoreFailure(Exception):
    """One reward call failed; the message is one line and names the function."""


class Scorer:
    """Turns rollouts into ``Score``s with a main reward function and weighted components.

    Args:
        reward_fn: the main reward function (``honing.rewards.registry`` gives the signature),
            or a ``BatchRewardFn``.
        weighted: ``(name, function, weight)`` components added to the main score.
        format_fn: shorthand for the component ``("format", format_fn, format_weight)``.
        format_weight: the format component's weight.
        on_error: ``"fail"``, ``"zero"`` or ``"drop"`` (module docstring).

    Attributes:
        last_latencies_ms: latency of each scoring call in the last ``score``: per rollout for
            plain functions; per request for batch functions that report their own
            ``last_latencies_ms`` (HTTP clients), else the batch's wall time.
        last_metrics: counters a batch function reported for the last ``score`` (errors,
            retries, cache hits, ...), for the training metrics.
    """

    def __init__(
        self,
        reward_fn: Callable[..., Any] | BatchRewardFn,
        *,
        weighted: Sequence[tuple[str, Callable[..., Any] | BatchRewardFn, float]] = (),
        format_fn: Callable[..., Any] | None = None,
        format_weight: float = 0.0,
        on_error: str = "fail",
    ) -> None:
        if on_error not in ON_ERROR_POLICIES:
            raise RewardError(f"reward.on_error must be one of fail, zero, drop; got {on_error!r}")
        self.reward_fn = reward_fn
        self.weighted = list(weighted)
        if format_fn is not None:
            self.weighted.append(("format", format_fn, format_weight))
        self.on_error = on_error
        self.last_latencies_ms: list[float] = []
        self.last_metrics: dict[str, float] = {}

    def score(
        self,
        prompts_by_id: dict[str, Prompt],
        rollouts: list[Rollout],
        rendered_prompts: dict[str, str] | None = None,
        on_error: str | None = None,
    ) -> list[Score]:
        """One ``Score`` per rollout, in order.

        Args:
            prompts_by_id: the prompts the rollouts answer, by ``Prompt.id``.
            rollouts: completions to score.
            rendered_prompts: the model's prompt text by id, passed as ``prompt=``; without
                it the raw prompt text (message contents joined by newlines) is passed.
            on_error: this call's failure policy instead of the scorer's own (validation
                takes the failures back to retry them).

        Raises:
            RewardError: a reward call failed and ``on_error == "fail"``.
            KeyError: a rollout's ``prompt_id`` is not in ``prompts_by_id`` (a caller bug).
        """
        rendered_prompts = rendered_prompts or {}
        items = []
        for rollout in rollouts:
            prompt = prompts_by_id[rollout.prompt_id]
            rendered = rendered_prompts.get(prompt.id)
            items.append(
                {
                    "response": rollout.text,
                    "ground_truth": prompt.ground_truth,
                    "data_source": prompt.data_source,
                    "extra_info": prompt.extra_info,
                    "prompt": rendered if rendered is not None else _prompt_text(prompt),
                }
            )
        self.last_latencies_ms, self.last_metrics = [], {}
        main = self._results(self.reward_fn, items)
        parts = [(name, weight, self._results(fn, items)) for name, fn, weight in self.weighted]
        scores = []
        for index, rollout in enumerate(rollouts):
            outcomes = [main[index]] + [results[index] for _, _, results in parts]
            failure = next((o for o in outcomes if isinstance(o, _ScoreFailure)), None)
            if failure is not None:
                prompt = prompts_by_id[rollout.prompt_id]
                scores.append(self._failed(prompt, str(failure), on_error or self.on_error))
                continue
            base, details = main[index]
            reward = base
            for (name, weight, _), (part, _) in zip(parts, outcomes[1:], strict=True):
                details[name] = part
                reward += weight * part
            if parts:
                details["base_score"] = base
            scores.append(Score(reward=reward, ok=True, details=details))
        return scores

    def _results(self, fn: Any, items: list[dict[str, Any]]) -> list[Any]:
        """``(score, details)`` per item, or the item's ``_ScoreFailure``."""
        raw, latencies_ms, metrics = score_items(fn, items)
        self.last_latencies_ms += latencies_ms
        for key, value in metrics.items():
            self.last_metrics[key] = self.last_metrics.get(key, 0.0) + value
        name = _function_name(fn)
        return [_outcome(name, result) for result in raw]

    def close(self) -> None:
        """Release what the reward functions hold (worker pools, connections)."""
        for fn in [self.reward_fn, *(fn for _, fn, _ in self.weighted)]:
            close = getattr(fn, "close", None)
            if callable(close):
                close()

    def _failed(self, prompt: Prompt, reason: str, on_error: str) -> Score:
        if on_error == "fail":
            raise self.failure(prompt.id, reason)
        reward = 0.0 if on_error == "zero" else math.nan
        return Score(reward=reward, ok=False, details={"error": reason})

    @staticmethod
    def failure(prompt_id: str, reason: str) -> RewardError:
        """The error a failed score raises under ``on_error=fail``."""
        return RewardError(
            f"{reason} (prompt {prompt_id}); fix the function, or set reward.on_error "
            "to 'zero' or 'drop' to record failures and continue"
        )


def score_items(
    fn: Any, items: list[dict[str, Any]]
) -> tuple[list[Any], list[float], dict[str, float]]:
    """Call a reward function on every item: in one ``score_batch`` call when it has one,
    else item by item.

    Returns:
        one raw result per item (what the function returned, or the exception it raised),
        latencies in ms (per item for plain functions; per request for batch functions that
        report ``last_latencies_ms``, else the batch's wall time), and the counters a batch
        function reported in ``last_metrics``.
    """
    if isinstance(fn, BatchRewardFn):
        start = time.perf_counter()
        try:
            raw = list(fn.score_batch(items))
        except Exception as exc:  # noqa: BLE001 - user reward code may raise anything
            raw = [exc] * len(items)
        elapsed_ms = (time.perf_counter() - start) * 1000.0
        if len(raw) != len(items):
            error = RuntimeError(f"score_batch returned {len(raw)} results for {len(items)} items")
            raw = [error] * len(items)
        latencies = list(getattr(fn, "last_latencies_ms", None) or [elapsed_ms])
        return raw, latencies, dict(getattr(fn, "last_metrics", None) or {})
    raw, latencies = [], []
    for item in items:
        start = time.perf_counter()
        context = {key: item[key] for key in ("prompt", "data_source", "extra_info") if key in item}
        try:
            raw.append(fn(item["response"], item.get("ground_truth"), **context))
        except Exception as exc:  # noqa: BLE001 - user reward code may raise anything
            raw.append(exc)
        latencies.append((time.perf_counter() - start) * 1000.0)
    return raw, latencies, {}


def _outcome(name: str, result: Any) -> tuple[float, dict[str, Any]] | _ScoreFailure:
    try:
        return _normalise(name, result)
    except _ScoreFailure as failure:
        return failure


def _normalise(name: str, result: Any) -> tuple[float, dict[str, Any]]:
    """A reward function's result as ``(score, details)``.

    Raises:
        _ScoreFailure: the result is an exception, or holds no finite number.
    """
    if isinstance(result, BaseException):
        raise _ScoreFailure(f"reward function {name} raised {describe_error(result)}")
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


def _function_name(fn: Any) -> str:
    if getattr(fn, "name", None):
        return str(fn.name)
    module = getattr(fn, "__module__", None)
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__  # a function, or an object
    return f"{module}.{name}" if module else name


def _short_repr(value: Any) -> str:
    text = " ".join(repr(value).split())
    return f"{type(value).__name__} {text[:60]}"
