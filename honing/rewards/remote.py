"""A reward function that asks a verifier service over HTTP (``reward.endpoint``).

Protocol: ``POST <endpoint>`` with JSON ``{"response", "ground_truth", "prompt",
"data_source", "extra_info"}``; the service answers ``200`` with ``{"score": float, ...}``
(other keys become details). Every call has a timeout and bounded retries with backoff on
connection errors and 5xx answers; a call that still fails raises, and the scorer's
``reward.on_error`` policy decides what happens (it is never silently scored 0).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any


class VerifierUnavailable(RuntimeError):
    """The verifier service did not give a usable answer within the retry budget."""


def remote_reward_fn(
    endpoint: str, *, timeout_s: float = 30.0, retries: int = 2, backoff_s: float = 0.2
) -> Callable[..., dict]:
    """Build a reward function (see ``honing.rewards.registry``) backed by ``endpoint``."""

    def remote_verifier(response: str, ground_truth: Any, **context: Any) -> dict:
        body = json.dumps(
            {"response": response, "ground_truth": ground_truth, **context}, default=str
        ).encode()
        last_error = ""
        for attempt in range(retries + 1):
            if attempt:
                time.sleep(backoff_s * 2 ** (attempt - 1))
            request = urllib.request.Request(
                endpoint, data=body, method="POST", headers={"Content-Type": "application/json"}
            )
            try:
                with urllib.request.urlopen(request, timeout=timeout_s) as answer:
                    return json.loads(answer.read())
            except urllib.error.HTTPError as err:
                last_error = f"HTTP {err.code} from {endpoint}"
                if err.code < 500:  # the request itself is wrong: retrying will not help
                    break
            except (urllib.error.URLError, TimeoutError, ConnectionError) as err:
                last_error = f"{endpoint} unreachable ({getattr(err, 'reason', err)})"
            except json.JSONDecodeError:
                last_error = f"{endpoint} answered with something that is not JSON"
                break
        raise VerifierUnavailable(f"{last_error} after {attempt + 1} attempt(s)")

    return remote_verifier
