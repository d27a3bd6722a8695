"""The HTTP side of a remote rollout engine (``OpenAIEngine``) and its weight senders: an
endpoint and what the engine knows of it, the failures worth trying elsewhere or later, and
one request with its failure sorted into them."""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from honing.errors import UserError

RETRYABLE_STATUS = {429, 500, 502, 503, 504}


class EngineUnavailable(UserError, RuntimeError):
    """No endpoint could serve a request or take new weights: every server is down or set
    aside. The run ends with one line naming each server and its last error (the servers
    need a person), whether the loss came while sampling or while sending weights."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))  # the servers' answers may hold newlines


class EngineRequestError(ValueError):
    """An endpoint refused a request as malformed (HTTP 4xx, its ``status``); retrying
    would not help."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class WeightsRefused(UserError, EngineRequestError):
    """A server refused new weights (HTTP 4xx: they do not fit its model, or another trainer
    holds it): one line naming the server and its reason."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))


class Retryable(Exception):
    """A failure another endpoint (or a later try) may not have: connection refused or reset,
    a timeout, HTTP 5xx or 429."""


@dataclass(eq=False)
class Endpoint:
    """A server and what the engine knows of it (one object per server: compared by
    identity)."""

    url: str
    down_until: float = 0.0  # set aside until then (time.monotonic)
    last_error: str = ""
    failures: int = 0
    version: int = 0  # the weight version it was last sent (or says it holds)


def request(client: httpx.Client, method: str, endpoint: Endpoint, path: str, **kwargs) -> dict:
    """The JSON answer of ``method endpoint.url+path``.

    Raises:
        Retryable: the request did not get through, or a 5xx or 429 answered it.
        EngineRequestError: any other 4xx (the server's message included).
    """
    try:
        response = client.request(method, endpoint.url + path, **kwargs)
    except httpx.HTTPError as err:  # connection refused or reset, timeout
        raise Retryable(f"{type(err).__name__}: {err}") from None
    if response.status_code in RETRYABLE_STATUS:
        raise Retryable(f"HTTP {response.status_code}: {_said(response)}")
    if response.status_code >= 400:
        raise EngineRequestError(
            f"{endpoint.url}{path} refused the request (HTTP {response.status_code}): "
            f"{_said(response)}",
            response.status_code,
        )
    return response.json() if response.content else {}  # vLLM's /health answers no body


def base_url(endpoint: str) -> str:
    """A server's root from an endpoint as configured: ``http://host:port``, ``.../v1`` or
    ``.../v1/completions`` -> ``http://host:port``."""
    url = endpoint.strip().rstrip("/")
    for suffix in ("/completions", "/v1"):
        url = url.removesuffix(suffix)
    return url


def first_model(urls: list[str], key: str, timeout_s: float, headers=None) -> str:
    """The first model the first answering server of ``urls`` (roots) lists at
    ``/v1/models``.

    Raises:
        UserError: none answers with a model; the message names ``key``, where to set it."""
    reasons = []
    for url in urls:
        try:
            answer = httpx.get(f"{url}/v1/models", timeout=timeout_s, headers=headers)
            return str(answer.json()["data"][0]["id"])
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as err:
            reasons.append(f"{url}/v1/models: {type(err).__name__}")
    raise UserError(f"no server named its model ({'; '.join(reasons)}); set {key}")


def _said(response: httpx.Response) -> str:
    """A refusal's message, on one line: the ``error.message`` of the OpenAI-compatible
    error body (vLLM's, SGLang's, honing's), or the body's start."""
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text
    return " ".join(str(message).split())[:300]
