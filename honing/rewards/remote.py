"""Client of one or several verifier / reward-model services (``reward.endpoint``).

``VerifierClient`` is a ``BatchRewardFn``: a batch of items is split into ``POST /score``
requests of ``request_items`` each (``{"items": [...]}`` → ``{"results": [{"score",
"details"}]}``, the envelope of ``honing serve``), sent concurrently (at most
``max_concurrency`` in flight) from an asyncio loop on a background thread. Another protocol
(a generative judge's completions: ``rewards/judge.py``) is a subclass with its own
``endpoint_url``, ``request_body`` and ``results``; everything below holds for it too.

What keeps scores flowing when a service misbehaves:

- every request has a timeout; a failed one (connection error, timeout, 5xx) is retried up to
  ``retries`` times with exponential backoff and jitter, on another replica when there is
  one; a busy answer (429, 503) is retried after the ``Retry-After`` it gives (else the
  backoff) for as long as that stays within ``timeout_s``;
- replicas are load-balanced (fewest requests in flight); a replica that fails
  ``eject_after`` requests in a row is ejected for ``eject_s`` (doubling on each ejection, at
  most a minute) and gets traffic again after that;
- a circuit breaker: after ``breaker_failures`` failed requests in a row across all replicas,
  requests fail at once for ``breaker_s`` instead of queueing on a dead service, then one
  request probes whether it is back;
- a cache of results by (data source, response, ground truth, extra info); identical items
  in one batch are sent once.

An item whose scoring still failed comes back as an exception, so the scorer's
``reward.on_error`` (``fail`` | ``zero`` | ``drop``) decides and counts it; never a silent 0.
Per-request latencies and counters (``reward/requests``, ``reward/errors``,
``reward/retries``, ``reward/cache_hits``, ``reward/ejections``) go into training metrics.
A bearer token is read from ``HONING_VERIFIER_TOKEN`` (kept out of config files).
"""

from __future__ import annotations

import asyncio
import email.utils
import hashlib
import json
import os
import random
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import httpx


class VerifierUnavailable(RuntimeError):
    """No usable answer for a request within the retry budget, or the circuit is open."""


@dataclass
class _Replica:
    url: str  # .../score
    in_flight: int = 0
    failures: int = 0  # consecutive
    ejections: int = 0
    ejected_until: float = 0.0


def score_url(endpoint: str) -> str:
    """``http://host:port`` or ``.../score`` → the ``/score`` URL."""
    endpoint = endpoint.strip().rstrip("/")
    return endpoint if endpoint.endswith("/score") else f"{endpoint}/score"


class VerifierClient:
    """Scores items through verifier services (module docstring for the behaviour).

    Args:
        endpoints: a URL, several separated by commas, or a list of URLs.
        timeout_s: limit of one HTTP request.
        retries: further attempts of a failed request.
        request_items: items per request.
        max_concurrency: requests in flight at once.
        cache_size: results remembered (0 = no cache).
        eject_after: consecutive failures that eject a replica.
        eject_s: first ejection's length.
        breaker_failures: consecutive failed requests (all replicas) that open the circuit.
        breaker_s: how long an open circuit fails requests at once.
        backoff_s: first retry's wait; doubles per attempt (times a jitter of 0.5-1.5).
    """

    name = "verifier-service"
    counters = (
        "reward/requests",
        "reward/errors",
        "reward/retries",
        "reward/cache_hits",
        "reward/ejections",
        "reward/failed_items",
    )

    def __init__(
        self,
        endpoints: str | list[str],
        *,
        timeout_s: float = 30.0,
        retries: int = 3,
        request_items: int = 64,
        max_concurrency: int = 8,
        cache_size: int = 100_000,
        eject_after: int = 2,
        eject_s: float = 5.0,
        breaker_failures: int = 8,
        breaker_s: float = 10.0,
        backoff_s: float = 0.1,
    ) -> None:
        urls = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
        self.replicas = [_Replica(self.endpoint_url(url)) for url in urls if url.strip()]
        if not self.replicas:
            raise ValueError("reward.endpoint: no URL given")
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self.request_items, self.max_concurrency = request_items, max_concurrency
        self.eject_after, self.eject_s = eject_after, eject_s
        self.breaker_failures, self.breaker_s = breaker_failures, breaker_s
        self.cache_size = cache_size
        self._cache: OrderedDict[str, dict] = OrderedDict()
        self._consecutive_failures = 0
        self._circuit_open_until = 0.0
        self._next = 0
        self._jitter = random.Random()
        token = os.environ.get("HONING_VERIFIER_TOKEN", "")
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._http: httpx.AsyncClient | None = None
        self.last_latencies_ms: list[float] = []
        self.last_metrics: dict[str, float] = {}

    @staticmethod
    def endpoint_url(endpoint: str) -> str:
        """Where a chunk of items is posted, from an endpoint as configured."""
        return score_url(endpoint)

    def request_body(self, items: list[dict]) -> dict[str, Any]:
        """The JSON body of one request for ``items``."""
        return {"items": items}

    def results(self, answer: httpx.Response, items: list[dict], url: str) -> list[Any]:
        """Per item of a 200 answer: ``{"score", **details}`` or the exception that failed
        it."""
        return _parse_results(answer, len(items), url)

    def score_batch(self, items: list[dict[str, Any]]) -> list[Any]:
        """One result per item: ``{"score", **details}`` or the exception that failed it."""
        self.last_latencies_ms, self.last_metrics = [], dict.fromkeys(self.counters, 0.0)
        keys = [_cache_key(item) for item in items]
        results: list[Any] = [self._cache_get(key) for key in keys]
        self.last_metrics["reward/cache_hits"] = float(sum(r is not None for r in results))
        todo: dict[str, dict] = {}
        for key, item, result in zip(keys, items, results, strict=True):
            if result is None and key not in todo:
                todo[key] = {k: item.get(k) for k in _ITEM_KEYS if k in item}
        if todo:
            future = asyncio.run_coroutine_threadsafe(self._score_all(todo), self._loop)
            scored = future.result()
            for index, key in enumerate(keys):
                if results[index] is None:
                    results[index] = scored[key]
        return results

    async def _score_all(self, todo: dict[str, dict]) -> dict[str, Any]:
        if self._http is None:
            limits = httpx.Limits(max_connections=self.max_concurrency * 2)
            self._http = httpx.AsyncClient(timeout=self.timeout_s, limits=limits)
        keys = list(todo)
        chunks = [keys[i : i + self.request_items] for i in range(0, len(keys), self.request_items)]
        gate = asyncio.Semaphore(self.max_concurrency)

        async def one(chunk: list[str]) -> list[Any]:
            async with gate:
                try:
                    return await self._request([todo[key] for key in chunk])
                except VerifierUnavailable as exc:
                    self.last_metrics["reward/failed_items"] += len(chunk)
                    return [exc] * len(chunk)

        answers = await asyncio.gather(*(one(chunk) for chunk in chunks))
        scored = {}
        for chunk, results in zip(chunks, answers, strict=True):
            for key, result in zip(chunk, results, strict=True):
                scored[key] = result
                if isinstance(result, dict):
                    self._cache_put(key, result)
        return scored

    async def _request(self, items: list[dict]) -> list[Any]:
        """POST one chunk, with retries across replicas; per-item results.

        A failure (unreachable, timeout, 5xx) uses one of ``retries``; a busy answer (429 or
        503) does not, but is tried again only while the wait it asks for (``Retry-After``,
        else the backoff) ends within ``timeout_s`` of the first attempt."""
        last_error, failures, busy, attempts, wait = "", 0, 0, 0, 0.0
        deadline = time.monotonic() + self.timeout_s
        while True:
            if attempts:
                self.last_metrics["reward/retries"] += 1
                await asyncio.sleep(wait)
            now = time.monotonic()
            if now < self._circuit_open_until:
                raise VerifierUnavailable(
                    f"verifier circuit open after {self._consecutive_failures} failed requests "
                    f"in a row (last: {last_error or 'see earlier errors'}); requests fail at "
                    f"once for another {self._circuit_open_until - now:.1f} s"
                )
            replica = self._pick(now)
            replica.in_flight += 1
            start = time.perf_counter()
            self.last_metrics["reward/requests"] += 1
            attempts += 1
            try:
                answer = await self._http.post(
                    replica.url, json=self.request_body(items), headers=self._headers
                )
            except httpx.HTTPError as exc:
                last_error = f"{replica.url} unreachable ({type(exc).__name__}: {exc})"
                answer = None
            finally:
                replica.in_flight -= 1
                self.last_latencies_ms.append((time.perf_counter() - start) * 1000.0)
            if answer is not None and answer.status_code == 200:
                results = self.results(answer, items, replica.url)
                self._succeeded(replica)
                return results
            if answer is not None:
                last_error = f"HTTP {answer.status_code} from {replica.url}: {answer.text[:200]}"
            if answer is not None and answer.status_code in (429, 503):
                # busy: no ejection, and not a failure; wait as asked (or back off) and retry
                self.last_metrics["reward/errors"] += 1
                busy += 1
                asked = retry_after_s(answer.headers.get("retry-after"))
                wait = asked if asked is not None else self._backoff(failures + busy)
                if time.monotonic() + wait > deadline:
                    raise VerifierUnavailable(
                        f"{last_error}: still busy after {attempts} attempt(s) within "
                        f"reward.timeout_s={self.timeout_s:g} s"
                    )
                continue
            if answer is not None and answer.status_code < 500:
                self.last_metrics["reward/errors"] += 1
                raise VerifierUnavailable(last_error)  # 4xx: the request itself is wrong
            self._failed(replica)
            failures += 1
            if failures > self.retries:
                raise VerifierUnavailable(f"{last_error} after {attempts} attempt(s)")
            wait = self._backoff(failures)

    def _backoff(self, failures: int) -> float:
        """Exponential backoff with jitter (0.5-1.5x), so clients that failed together do
        not all come back at the same instant."""
        return self.backoff_s * 2 ** (failures - 1) * self._jitter.uniform(0.5, 1.5)

    def _pick(self, now: float) -> _Replica:
        """The healthy replica with fewest requests in flight (round-robin on ties); when all
        are ejected, the one whose ejection ends first."""
        healthy = [r for r in self.replicas if r.ejected_until <= now]
        if not healthy:
            return min(self.replicas, key=lambda r: r.ejected_until)
        self._next += 1
        order = sorted(
            range(len(healthy)),
            key=lambda i: (healthy[i].in_flight, (i - self._next) % len(healthy)),
        )
        return healthy[order[0]]

    def _failed(self, replica: _Replica) -> None:
        self.last_metrics["reward/errors"] += 1
        replica.failures += 1
        self._consecutive_failures += 1
        if replica.failures >= self.eject_after:
            replica.ejections += 1
            replica.failures = 0
            length = min(60.0, self.eject_s * 2 ** (replica.ejections - 1))
            replica.ejected_until = time.monotonic() + length
            self.last_metrics["reward/ejections"] += 1
        if self._consecutive_failures >= self.breaker_failures:
            self._circuit_open_until = time.monotonic() + self.breaker_s

    def _succeeded(self, replica: _Replica) -> None:
        replica.failures = replica.ejections = 0
        replica.ejected_until = 0.0
        self._consecutive_failures = 0

    def _cache_get(self, key: str) -> dict | None:
        if key not in self._cache:
            return None
        self._cache.move_to_end(key)
        return dict(self._cache[key])

    def _cache_put(self, key: str, result: dict) -> None:
        if self.cache_size <= 0:
            return
        self._cache[key] = result
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)

    def close(self) -> None:
        """Close connections and stop the background loop."""
        if self._http is not None:
            asyncio.run_coroutine_threadsafe(self._http.aclose(), self._loop).result()
            self._http = None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)


_ITEM_KEYS = ("response", "ground_truth", "data_source", "extra_info", "prompt")


def retry_after_s(value: str | None) -> float | None:
    """A ``Retry-After`` header as seconds from now (a number of seconds or an HTTP date);
    ``None`` when absent or unreadable."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        return None
    return max(0.0, when.timestamp() - time.time())


def _cache_key(item: dict[str, Any]) -> str:
    """The item's identity: a reward model's score depends on the prompt too."""
    fields = [item.get(k) for k in ("data_source", "response", "ground_truth", "extra_info")]
    fields.append(item.get("prompt"))
    text = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def _parse_results(answer: httpx.Response, count: int, url: str) -> list[Any]:
    """The ``results`` of a 200 answer as ``{"score", **details}`` or an exception per item."""
    try:
        results = answer.json()["results"]
    except (ValueError, KeyError, TypeError):
        return [VerifierUnavailable(f"{url} answered without a 'results' list")] * count
    if not isinstance(results, list) or len(results) != count:
        got = len(results) if isinstance(results, list) else type(results).__name__
        return [VerifierUnavailable(f"{url} answered {got} results for {count} items")] * count
    out: list[Any] = []
    for result in results:
        if not isinstance(result, dict) or result.get("score") is None:
            reason = result.get("error") if isinstance(result, dict) else None
            out.append(VerifierUnavailable(f"{url} could not score the item: {reason}"))
            continue
        out.append({"score": result["score"], **(result.get("details") or {})})
    return out
