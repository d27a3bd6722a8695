"""The HTTP shell shared by ``honing serve verifier`` and ``honing serve reward-model``.

``POST /score`` takes ``{"items": [{"data_source", "response", "ground_truth",
"extra_info", "prompt"?}, ...]}`` and answers ``{"results": [{"score": float, "details":
{...}}, ...]}`` in the same order; an item that could not be scored (a verifier bug, not a
wrong answer) answers ``{"score": null, "error": "..."}`` so the client's ``on_error`` policy
counts it. ``GET /health`` says the service is up and what it runs; ``GET /metrics`` is
Prometheus text.

Guards: a request body limit (413), a bearer token when configured (401), validation with a
message naming the bad field (422: a field the service requires is missing or null, a field
has the wrong type, the body is not JSON or is nested too deeply to parse), and bounded
concurrency with back-pressure: at most ``max_concurrency`` requests are scored at once and
``max_queue`` wait; past that a request is refused at once with 503 and ``Retry-After``
rather than piling up (the client retries elsewhere or later). With a token, ``/health``
answers a bare ``{"status": "ok"}`` to anyone (load balancers, container health checks) and
its details only with the token; ``/metrics`` needs the token. The connection guards (slow
clients, open connections, keep-alive) are the server's: ``honing.services.server``.

``create_app`` is the one way every service does these: the rollout server (which has no
``/score``) adds its routes to the app it returns, under the same token, ``/health`` and
``/metrics``; a route refuses a request by raising ``Refused``, answered in the service's error
shape. ``honing_requests_total`` counts the answers to every request but health checks and
scrapes, by status code. The page is written by ``prometheus_client`` from the app's own
registry, so every label value (a verdict, a model name) is escaped as the format requires.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import math
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString
from starlette.datastructures import Headers

from honing.monitor.prometheus import CONTENT_TYPE
from honing.rewards.registry import describe_error

_UNAUTHORISED = "missing or wrong bearer token (Authorization: Bearer ...)"
_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_REQUESTS_HELP = "answers to requests (health checks and scrapes aside), by status code"


class _Metrics:
    """A service's counters and latency histogram: a prometheus_client collector, read at
    each scrape."""

    def __init__(self, service: str) -> None:
        self.service = service
        self.requests: Counter[str] = Counter()  # by status code
        self.items: Counter[str] = Counter()  # by verdict
        self.buckets = [0] * len(_BUCKETS_S)
        self.latency_sum = 0.0
        self.latency_count = 0
        self.in_flight = 0
        self.waiting = 0

    def observe(self, seconds: float) -> None:
        self.latency_sum += seconds
        self.latency_count += 1
        for index, bound in enumerate(_BUCKETS_S):
            if seconds <= bound:
                self.buckets[index] += 1

    def collect(self) -> Iterator[Metric]:
        service = [self.service]
        for name, help_text, key, counts in (
            ("honing_requests", _REQUESTS_HELP, "code", self.requests),
            ("honing_items", "items scored, by verdict", "verdict", self.items),
        ):
            family = CounterMetricFamily(name, help_text, labels=["service", key])
            for value, count in sorted(counts.items()):
                family.add_metric([*service, value], count)
            yield family
        latency = HistogramMetricFamily(
            "honing_request_seconds", "seconds to answer a /score request", labels=["service"]
        )
        bounds = [floatToGoString(bound) for bound in _BUCKETS_S]
        buckets = [*zip(bounds, self.buckets, strict=True), ("+Inf", self.latency_count)]
        latency.add_metric(service, buckets, self.latency_sum)
        yield latency
        for name, help_text, value in (
            ("honing_in_flight", "requests being scored", self.in_flight),
            ("honing_waiting", "requests waiting to be scored", self.waiting),
        ):
            gauge = GaugeMetricFamily(name, help_text, labels=["service"])
            gauge.add_metric(service, value)
            yield gauge


class Refused(Exception):
    """A request a service refuses: ``status`` (4xx) and a message naming the field at fault
    and what is expected."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


_FIELD_TYPES = {"response": str, "data_source": str, "prompt": str, "extra_info": dict}
_TYPE_NAMES = {str: "a string", dict: "an object"}


def parse_items(body: bytes, required: tuple[str, ...] = ("response",)) -> list[dict[str, Any]]:
    """The ``items`` of a ``/score`` body, checked field by field; each of ``required`` must be
    present and not null in every item.

    Raises:
        Refused: (422) not JSON, nested too deeply, no ``items`` list, a required field
            missing, or a field of the wrong type.
    """
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise Refused(f"body is not JSON ({exc})", 422) from None
    except RecursionError:
        raise Refused("body is nested too deeply to parse", 422) from None
    items = payload.get("items") if isinstance(payload, dict) else None
    if not isinstance(items, list):
        raise Refused('expected {"items": [...]}', 422)
    for index, item in enumerate(items):
        where = f"items[{index}]"
        if not isinstance(item, dict):
            raise Refused(f"{where}: expected an object", 422)
        for key in required:
            if item.get(key) is None:
                raise Refused(
                    f"{where}.{key}: missing or null (every item needs {', '.join(required)})",
                    422,
                )
        for key, kind in _FIELD_TYPES.items():
            if item.get(key) is not None and not isinstance(item[key], kind):
                raise Refused(f"{where}.{key}: expected {_TYPE_NAMES[kind]}", 422)
        item.setdefault("data_source", "")
        item["extra_info"] = item.get("extra_info") or {}
    return items


def result_json(result: Any) -> tuple[dict[str, Any], str]:
    """One scorer result as the wire form, and its verdict for the metrics."""
    if isinstance(result, BaseException):
        return {"score": None, "error": describe_error(result)}, "error"
    if isinstance(result, dict):
        score, details = result.get("score"), {k: v for k, v in result.items() if k != "score"}
    else:
        score, details = result, {}
    try:
        score = float(score)
    except (TypeError, ValueError):
        return {"score": None, "error": f"scorer returned {score!r}"}, "error"
    if not math.isfinite(score):
        return {"score": None, "error": f"scorer returned {score}"}, "error"
    return {"score": score, "details": details}, str(details.get("verdict", "scored"))


async def read_body(request: Request, max_bytes: int) -> bytearray:
    """The request's body, read no further than ``max_bytes``: into one buffer of its
    declared length as the chunks come (a weight bucket of hundreds of MB is copied once).

    Raises:
        Refused: (413) the body is over ``max_bytes``.
    """
    declared = int(request.headers.get("content-length") or 0)
    if declared > max_bytes:
        raise Refused(f"body of {declared} bytes is over the {max_bytes} limit", 413)
    body, size = bytearray(declared), 0
    async for chunk in request.stream():
        end = size + len(chunk)
        if end > max_bytes:
            raise Refused(f"body is over the {max_bytes}-byte limit", 413)
        if end <= len(body):
            body[size:end] = chunk
        else:  # more than it declared (or no length): the rest appended
            del body[size:]
            body += chunk
        size = end
    del body[size:]  # less than it declared
    return body


def plain_error(code: int, message: str) -> dict[str, Any]:
    """The scoring services' error body: ``{"error": message}``."""
    return {"error": message}


class _Gate:
    """ASGI middleware in front of every route: with a token, a request without it is refused
    (401), except ``/health``, which decides for itself what to tell; the answers to every
    request but health checks and scrapes are counted by status code."""

    def __init__(self, app, *, token: str, refuse, counts: Counter[str]) -> None:
        self.app, self.token, self.refuse, self.counts = app, token, refuse, counts

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if path not in ("/health", "/metrics"):
            send = self._counting(send)
        if path != "/health" and not authorised(scope, self.token):
            await self.refuse(401, _UNAUTHORISED)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _counting(self, send):
        async def counted(message) -> None:
            if message["type"] == "http.response.start":
                self.counts[str(message["status"])] += 1
            await send(message)

        return counted


def authorised(scope, token: str) -> bool:
    """Whether the request of ``scope`` carries ``Authorization: Bearer TOKEN`` (any request
    does when there is no token)."""
    if not token:
        return True
    given = Headers(scope=scope).get("authorization", "").encode()
    return hmac.compare_digest(given, f"Bearer {token}".encode())


def create_app(
    scorer: Any = None,
    *,
    service: str,
    required: tuple[str, ...] = ("response",),
    health: Callable[[], dict[str, Any]] | None = None,
    token: str = "",
    max_body_bytes: int = 16 << 20,
    max_concurrency: int = 8,
    max_queue: int = 64,
    error_body: Callable[[int, str], dict[str, Any]] = plain_error,
    collectors: Sequence[Collector] = (),
) -> FastAPI:
    """A FastAPI app under the guards of the module docstring, serving ``scorer.score_batch``
    at ``POST /score`` when there is a scorer.

    Args:
        required: the item fields the scorer cannot do without.
        health: adds fields to ``GET /health``'s details.
        error_body: the JSON body of a refusal, from its status code and message.
        collectors: more metrics for ``GET /metrics``: objects whose ``collect()`` yields
            prometheus_client metric families.
    """
    metrics = _Metrics(service)
    registry = CollectorRegistry()  # the app's own: apps in one process keep their counts apart
    for collector in (metrics, *collectors):
        registry.register(collector)
    executor = (
        ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix=service)
        if scorer is not None
        else None
    )

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)
        closer = getattr(scorer, "close", None)
        if callable(closer):
            closer()

    app = FastAPI(title=f"honing {service}", docs_url=None, redoc_url=None, lifespan=lifespan)

    def refuse(code: int, message: str, **headers: str) -> JSONResponse:
        return JSONResponse(error_body(code, message), status_code=code, headers=headers)

    app.add_middleware(_Gate, token=token, refuse=refuse, counts=metrics.requests)

    @app.exception_handler(Refused)
    async def refused(_: Request, exc: Refused) -> JSONResponse:
        return refuse(exc.status, str(exc))

    @app.get("/health")
    async def healthz(request: Request) -> dict[str, Any]:
        if not authorised(request.scope, token):
            return {"status": "ok"}
        queue = {"in_flight": metrics.in_flight, "waiting": metrics.waiting} if scorer else {}
        return {"status": "ok", "service": service, **queue, **(health() if health else {})}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE)

    if scorer is not None:
        limits = (required, max_body_bytes, max_concurrency, max_queue)
        _score_route(app, scorer, executor, metrics, refuse, *limits)
    return app


def _score_route(
    app: FastAPI,
    scorer: Any,
    executor: ThreadPoolExecutor,
    metrics: _Metrics,
    refuse: Callable[..., JSONResponse],
    required: tuple[str, ...],
    max_body_bytes: int,
    max_concurrency: int,
    max_queue: int,
) -> None:
    """``POST /score``: the items parsed, then scored on ``executor`` under bounded
    concurrency with back-pressure (503 past ``max_queue`` waiting)."""
    gate = asyncio.Semaphore(max_concurrency)

    @app.post("/score")
    async def score(request: Request) -> JSONResponse:
        items = parse_items(await read_body(request, max_body_bytes), required)
        if metrics.in_flight + metrics.waiting >= max_concurrency + max_queue:
            return refuse(
                503, "busy: too many requests waiting; retry later", **{"Retry-After": "1"}
            )
        start = time.perf_counter()
        metrics.waiting += 1
        try:
            async with gate:
                metrics.waiting -= 1
                metrics.in_flight += 1
                try:
                    loop = asyncio.get_running_loop()
                    raw = await loop.run_in_executor(executor, scorer.score_batch, items)
                finally:
                    metrics.in_flight -= 1
        except Exception as exc:  # noqa: BLE001 - a scorer crash fails the request, not the server
            return refuse(500, f"scoring failed: {describe_error(exc)}")
        results = []
        for result in raw:
            wire, verdict = result_json(result)
            metrics.items[verdict] += 1
            results.append(wire)
        metrics.observe(time.perf_counter() - start)
        return JSONResponse({"results": results})
