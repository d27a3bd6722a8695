"""``honing serve verifier``: the rule verifiers (math, code in a sandbox, numeric) over HTTP.

Items are routed by ``data_source`` with the same table as ``reward.function: auto``
(``honing.rewards.routing``), so a trainer pointed at this service with
``reward.endpoint`` scores exactly as it would in-process; ``--function`` names a reward
function for data sources the table does not know, and ``--route DATA_SOURCE=SPEC`` adds or
overrides a route. ``--workers`` is the number of math worker processes and of programs run
at once. Every item needs a ``response`` and a ``ground_truth`` (any JSON value but null:
the verifiers take strings, numbers, lists of accepted answers, and the code verifier's test
objects); an item without them is a 422.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI

from honing.rewards.routing import DEFAULT_ROUTES, RewardRouter, VerifierSettings, build_builtin
from honing.services.app import create_app


def verifier_app(
    *,
    workers: int = 0,
    function: str = "",
    routes: dict[str, str] | None = None,
    math_timeout_s: float = 5.0,
    code_timeout_s: float = 10.0,
    delay_s: float = 0.0,
    **guards: Any,
) -> FastAPI:
    """The verifier service app; ``guards`` go to ``create_app`` (token, limits).

    ``delay_s`` holds every request that long before scoring it: the latency of a remote
    judge or a loaded verifier, for measuring how a trainer copes with slow scoring."""
    settings = VerifierSettings(workers, math_timeout_s, code_timeout_s)
    fallback = build_builtin(function, settings) if function else None
    table = DEFAULT_ROUTES | (routes or {})
    router = RewardRouter(table, fallback=fallback, settings=settings)
    health = {"routes": table, "fallback": function or None, "workers": workers}
    if delay_s > 0:
        router, health["delay_s"] = _Delayed(router, delay_s), delay_s
    from honing.sandbox.isolation import detect_backend

    health["isolation"] = detect_backend()  # what code runs in: bwrap, unshare or none
    required = ("response", "ground_truth")
    return create_app(
        router, service="verifier", required=required, health=lambda: health, **guards
    )


class _Delayed:
    """A scorer that waits ``delay_s`` before each batch it scores."""

    def __init__(self, scorer: Any, delay_s: float):
        self.scorer, self.delay_s = scorer, delay_s

    def score_batch(self, items: list[dict[str, Any]]) -> list[Any]:
        time.sleep(self.delay_s)
        return self.scorer.score_batch(items)

    def close(self) -> None:
        self.scorer.close()
