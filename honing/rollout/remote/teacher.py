"""A teacher behind OpenAI-compatible servers (vLLM, ``honing serve rollout``), for on-policy
distillation (``algorithm.teacher_endpoint``): its logprob of each token the student sampled.

Each sample is sent as token ids, its prompt then its response, in ``POST /v1/completions``
with ``max_tokens: 1`` and vLLM's ``prompt_logprobs: 0``: the answer's ``prompt_logprobs``
hold the server model's logprob of every token after the ones before it, and the response's
are read from their positions. Requests of ``request_rows`` samples go to the servers in turn;
a failed one is tried on the next, ``retries`` more times; what still fails stops the run
with the servers' last answer (a teacher's missing logprobs cannot be made up). Before the
first step ``check_tokenizer`` compares the servers' ``/tokenize`` of a few texts with the
policy's tokenizer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import httpx

from honing.errors import ConfigError, UserError
from honing.rollout.remote.http import base_url, first_model


class RemoteTeacher:
    """Teacher logprobs from servers (see the module).

    Args:
        endpoints: the servers' URLs, comma-separated.
        model: the served model ("": the first server's first model).
        timeout_s: one request's limit; ``retries``: further tries on the other servers.
        request_rows: samples per request.
    """

    def __init__(
        self,
        endpoints: str,
        *,
        model: str = "",
        timeout_s: float = 600.0,
        retries: int = 2,
        request_rows: int = 64,
    ) -> None:
        self.urls = [base_url(url) for url in endpoints.split(",") if url.strip()]
        if not self.urls:
            raise ConfigError("algorithm.teacher_endpoint: no URL given")
        self.model, self.timeout_s, self.retries = model, timeout_s, retries
        self.request_rows = request_rows
        self._client = httpx.Client(timeout=timeout_s)
        self._next = 0

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """``body`` to ``path`` on the servers in turn until one answers 200."""
        last = ""
        for _ in range(self.retries + 1):
            url = self.urls[self._next % len(self.urls)] + path
            self._next += 1
            try:
                answer = self._client.post(url, json=body)
            except httpx.HTTPError as err:
                last = f"{url} unreachable ({type(err).__name__})"
                continue
            if answer.status_code == 200:
                return answer.json()
            last = f"HTTP {answer.status_code} from {url}: {answer.text[:200]}"
            if 400 <= answer.status_code < 500:
                break  # the request itself is wrong: no other server takes it either
        raise UserError(f"algorithm.teacher_endpoint: no teacher logprobs ({last})")

    def _served_model(self) -> str:
        if not self.model:
            self.model = first_model(self.urls, "algorithm.teacher_model", self.timeout_s)
        return self.model

    def check_tokenizer(self, tokenizer, texts: Sequence[str]) -> None:
        """Raises ConfigError unless the servers tokenize ``texts`` as ``tokenizer`` does."""
        for text in texts:
            ours = tokenizer(text, add_special_tokens=False)["input_ids"]
            answer = self._post("/tokenize", {"prompt": text, "add_special_tokens": False})
            theirs = answer.get("tokens")
            if theirs != ours:
                raise ConfigError(
                    f"algorithm.teacher_endpoint: the teacher's tokenizer is not the policy's "
                    f"({text[:40]!r} is {theirs!r:.80} there, {ours!r:.80} here); "
                    "distillation compares the two models' logprobs of the same token ids"
                )

    def response_logprobs(
        self, samples: Sequence[tuple[list[int], list[int]]]
    ) -> list[list[float]]:
        """The teacher's logprob of each response token of each (prompt ids, response ids)."""
        out: list[list[float]] = []
        model = self._served_model()
        for start in range(0, len(samples), self.request_rows):
            chunk = samples[start : start + self.request_rows]
            body = {
                "model": model,
                "prompt": [list(prompt) + list(response) for prompt, response in chunk],
                "max_tokens": 1,
                "temperature": 0.0,
                "prompt_logprobs": 0,
            }
            choices = sorted(self._post("/v1/completions", body)["choices"], key=_index)
            for (prompt, response), choice in zip(chunk, choices, strict=True):
                scored = choice.get("prompt_logprobs") or []
                row = []
                for position, token in enumerate(response, start=len(prompt)):
                    entry = scored[position] if position < len(scored) else None
                    value = (entry or {}).get(str(token)) or (entry or {}).get(token)
                    if value is None:
                        raise UserError(
                            "algorithm.teacher_endpoint: the server gave no prompt logprob of "
                            f"token {token} at position {position}; it must support vLLM's "
                            "prompt_logprobs"
                        )
                    row.append(float(value["logprob"] if isinstance(value, dict) else value))
                out.append(row)
        return out

    def close(self) -> None:
        self._client.close()


def _index(choice: dict[str, Any]) -> int:
    return int(choice.get("index", 0))
