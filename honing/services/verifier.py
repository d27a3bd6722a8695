"""``honing serve verifier``: the rule verifiers (math, code in a sandbox, numeric) over HTTP.

Items are routed by ``data_source`` with the same table as ``reward.function: auto``
(``honing.rewards.routing``), so a trainer pointed at this service with
``reward.endpoint`` scores exactly as it would in-process; ``--function`` names a reward
function for data sources the table does not know, and ``--route DATA_SOURCE=SPEC`` adds or
overrides a route. ``--workers`` is the number of math
worker processes and of programs run at once.
"""

from __future__ import annotations

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
    **guards: Any,
) -> FastAPI:
    """The verifier service app; ``guards`` go to ``create_app`` (token, limits)."""
    settings = VerifierSettings(workers, math_timeout_s, code_timeout_s)
    fallback = build_builtin(function, settings) if function else None
    table = DEFAULT_ROUTES | (routes or {})
    router = RewardRouter(table, fallback=fallback, settings=settings)
    health = {"routes": table, "fallback": function or None, "workers": workers}
    from honing.rewards.sandbox import detect_backend

    health["isolation"] = detect_backend()  # what code runs in: bwrap, unshare or none
    return create_app(router, service="verifier", health=lambda: health, **guards)
