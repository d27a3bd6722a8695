"""Route each sample to a reward function by its ``data_source``, like verl's default scorer.

``reward.function: auto`` scores a dataset by what it is: rows whose ``data_source`` names a
math set go to the math verifier, code sets to the sandboxed code verifier, the built-in
arithmetic task to the numeric check. verl's dataset names are routes too, so a verl parquet
file scores without changes. ``reward.routes`` adds or overrides routes (``{data_source:
function spec}``); a route key may be a shell pattern (``aime*``). A data source with no route
is an error at load time (``unrouted``), never a silent 0.

Built-in names resolve to batch-capable verifiers sharing one worker budget
(``reward.workers``): ``math`` (``honing.rewards.math.verifier``), ``code``
(``honing.rewards.code_verifier``), ``judge`` (a generative judge's client,
``honing.rewards.judge``), plus the plain registry functions (``numeric``, ``format``) and
user functions (``module:function``, ``file.py:function``).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from honing.errors import RewardError
from honing.rewards.registry import load_reward_fn
from honing.rewards.scorer import score_items

# verl's data_source names (verl/utils/reward_score/__init__.py) and ours, by verifier.
DEFAULT_ROUTES: dict[str, str] = {
    **dict.fromkeys(
        (
            "math",
            "gsm8k",
            "openai/gsm8k",
            "lighteval/MATH",
            "DigitalLearningGmbH/MATH-lighteval",
            "HuggingFaceH4/MATH-500",
            "math_dapo",
            "math_dapo_reasoning",
            "aime*",
            "numina_*",
        ),
        "math",
    ),
    **dict.fromkeys(
        (
            "code",
            "codecontests",
            "apps",
            "codeforces",
            "taco",
            "humaneval",
            "openai_humaneval",
            "mbpp",
        ),
        "code",
    ),
    "arithmetic": "numeric",
}


_HEAVY_BUILTINS = ("math", "code")  # worker pools and sandboxes: made on first use
JUDGE = "judge"  # a generative judge (rewards/judge.py), built from reward.judge_*


@dataclass(frozen=True)
class VerifierSettings:
    """Settings of the built-in verifiers (``reward.workers``, ``*_timeout_s``)."""

    workers: int = 0  # processes / sandboxes at once; 0 = one per core
    math_timeout_s: float = 5.0
    code_timeout_s: float = 10.0
    judge: dict | None = None  # the judge's JudgeClient options (reward.judge_*)


def build_builtin(spec: str, settings: VerifierSettings) -> Any:
    """A reward function for ``spec``: the batch verifiers for ``math``/``code``, the
    generative judge's client for ``judge``, else whatever ``load_reward_fn`` resolves."""
    workers = settings.workers or None
    if spec == "judge":
        from honing.rewards.judge import JudgeClient

        if not settings.judge:
            raise RewardError("the judge reward needs reward.judge_endpoint: its servers' URLs")
        return JudgeClient(**settings.judge)
    if spec == "math":
        from honing.rewards.math.verifier import MathVerifier

        return MathVerifier(workers=workers, timeout_s=settings.math_timeout_s)
    if spec == "code":
        from honing.rewards.code_verifier import CodeVerifier

        return CodeVerifier(workers=workers, timeout_s=settings.code_timeout_s)
    return load_reward_fn(spec)


class RewardRouter:
    """A ``BatchRewardFn`` that sends each item to the reward function of its data source.

    Args:
        routes: ``{data_source or pattern: function spec}``; exact names win over patterns,
            patterns are tried in order.
        fallback: the function for data sources no route matches (``None``: unrouted is an
            error for that item).
        settings: for the built-in verifiers.
        resolve: builds a function from a spec (tests and services pass their own).
    """

    name = "router"

    def __init__(
        self,
        routes: dict[str, str],
        *,
        fallback: Any = None,
        settings: VerifierSettings = VerifierSettings(),
        resolve: Callable[[str, VerifierSettings], Any] = build_builtin,
    ) -> None:
        self.routes = dict(routes)
        self.fallback = fallback
        self._settings, self._resolve = settings, resolve
        self._functions: dict[str, Any] = {}
        for spec in dict.fromkeys(self.routes.values()):
            if spec not in _HEAVY_BUILTINS:
                self._function(spec)  # a user function's load error surfaces now
        self.last_latencies_ms: list[float] = []
        self.last_metrics: dict[str, float] = {}

    def route(self, data_source: str) -> str | None:
        """The spec that scores ``data_source``; ``None`` means the fallback."""
        if data_source in self.routes:
            return self.routes[data_source]
        for pattern, spec in self.routes.items():
            if fnmatch.fnmatchcase(data_source, pattern):
                return spec
        return None

    def _function(self, spec: str) -> Any:
        if spec not in self._functions:
            self._functions[spec] = self._resolve(spec, self._settings)
        return self._functions[spec]

    def prepare(self, data_sources: set[str]) -> None:
        """Load the functions these data sources need now (the built-in verifiers load on
        first use otherwise)."""
        for source in data_sources:
            spec = self.route(source)
            if spec is not None:
                self._function(spec)

    def unrouted(self, data_sources: set[str]) -> list[str]:
        """The data sources nothing would score (empty when there is a fallback)."""
        if self.fallback is not None:
            return []
        return sorted(s for s in data_sources if self.route(s) is None)

    def score_batch(self, items: list[dict[str, Any]]) -> list[Any]:
        """One result per item, in order; each route's items go to its function together."""
        groups: dict[int, tuple[Any, list[int]]] = {}
        results: list[Any] = [None] * len(items)
        for index, item in enumerate(items):
            spec = self.route(item.get("data_source", ""))
            fn = self._function(spec) if spec is not None else self.fallback
            if fn is None:
                results[index] = RewardError(
                    f"no reward function for data_source {item.get('data_source')!r}; add it "
                    "to reward.routes or set reward.function"
                )
                continue
            groups.setdefault(id(fn), (fn, []))[1].append(index)
        self.last_latencies_ms, self.last_metrics = [], {}
        for fn, indices in groups.values():
            outs, latencies_ms, metrics = score_items(fn, [items[i] for i in indices])
            self.last_latencies_ms += latencies_ms
            for key, value in metrics.items():
                self.last_metrics[key] = self.last_metrics.get(key, 0.0) + value
            for index, out in zip(indices, outs, strict=True):
                results[index] = out
        return results

    def close(self) -> None:
        """Close the verifiers' worker pools."""
        for fn in [*self._functions.values(), self.fallback]:
            close = getattr(fn, "close", None)
            if callable(close):
                close()


def build_router(
    function: str,
    routes: dict[str, str],
    settings: VerifierSettings,
    *,
    fallback: Any = None,
) -> RewardRouter:
    """The main reward of a run: ``auto`` routes by the default table, any other spec is the
    fallback; ``routes`` add to / override either. A given ``fallback`` (a verifier-service
    client) takes the place of the spec."""
    table = dict(DEFAULT_ROUTES) if function == "auto" and fallback is None else {}
    table |= routes
    if fallback is None and function != "auto":
        fallback = build_builtin(function, settings)
    return RewardRouter(table, fallback=fallback, settings=settings)
