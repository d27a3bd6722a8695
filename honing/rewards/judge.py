"""A generative judge as reward (``reward.function=judge``): a model served behind an
OpenAI-compatible completions API (vLLM, SGLang, ``honing serve rollout``) grades each answer.

Each item becomes a prompt from ``template``, with ``{question}`` (the prompt's text),
``{answer}`` (the response) and ``{reference}`` (the ground truth, or ``(none)``) put in; a
chunk of ``request_items`` items is one ``POST /v1/completions`` with a list of prompts, at
temperature 0, and each reply is read by the verdict parser:

- ``score``: the last number in the reply, which must lie in ``[0, score_max]``; the reward
  is that number / ``score_max``;
- ``label``: the last of ``labels``' words in the reply (whole words, any case); the reward
  is its value (``{"correct": 1, "incorrect": 0}`` by default).

A reply the parser cannot read is a format error: scored ``format_score``, marked
``judge_format_error`` in the sample's details (with the reply's start), and counted in
``reward/judge_format_errors``; it is not a failed score. Timeouts, retries across replicas,
ejection, the circuit breaker, busy answers and the cache are ``VerifierClient``'s
(``rewards/remote.py``): a judge that hangs or answers errors fails its items as a verifier
service's would, for ``reward.on_error`` to decide. With no ``model`` the server's first
model (``GET /v1/models``) is asked.
"""

from __future__ import annotations

import re
from typing import Any

import httpx

from honing.rewards.remote import VerifierClient, VerifierUnavailable
from honing.rollout.remote.http import base_url, first_model

DEFAULT_TEMPLATE = """You grade an answer to a question against a reference answer.

Question:
{question}

Reference answer:
{reference}

Answer to grade:
{answer}

Reply with one line, "Score: 1" if the answer is correct and "Score: 0" if it is not.
"""
DEFAULT_LABELS = {"correct": 1.0, "incorrect": 0.0}
NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)")
VERDICTS = ("score", "label")


def render(template: str, item: dict[str, Any]) -> str:
    """``template`` with the item's question, answer and reference put in."""
    reference = item.get("ground_truth")
    values = {
        "{question}": str(item.get("prompt") or ""),
        "{answer}": str(item.get("response") or ""),
        "{reference}": "(none)" if reference in (None, "") else str(reference),
    }
    return re.sub("|".join(map(re.escape, values)), lambda m: values[m.group(0)], template)


def read_score(reply: str, score_max: float) -> float | None:
    """The reply's last number over ``score_max``; None when there is none in range."""
    numbers = NUMBER.findall(reply)
    if not numbers:
        return None
    value = float(numbers[-1])
    return value / score_max if 0.0 <= value <= score_max else None


def read_label(reply: str, labels: dict[str, float]) -> float | None:
    """The value of the last of ``labels`` in the reply (whole words, any case)."""
    pattern = r"\b(" + "|".join(map(re.escape, sorted(labels, key=len, reverse=True))) + r")\b"
    found = re.findall(pattern, reply, flags=re.IGNORECASE)
    if not found:
        return None
    by_word = {word.lower(): value for word, value in labels.items()}
    return float(by_word[found[-1].lower()])


class JudgeClient(VerifierClient):
    """Scores items by a generative judge's replies (see the module).

    Args:
        endpoints: the judge servers' URLs, comma-separated.
        model: the served model to ask ("" : the server's first).
        template: the grading prompt, with ``{question}``, ``{answer}``, ``{reference}``.
        verdict: ``score`` or ``label``; ``score_max`` and ``labels`` configure them.
        max_tokens: the longest reply.
        format_score: the reward of a reply the parser cannot read.
        **options: ``VerifierClient``'s (timeouts, retries, batching, cache).
    """

    name = "judge"
    counters = (*VerifierClient.counters, "reward/judge_format_errors")

    def __init__(
        self,
        endpoints: str,
        *,
        model: str = "",
        template: str = DEFAULT_TEMPLATE,
        verdict: str = "score",
        score_max: float = 1.0,
        labels: dict[str, float] | None = None,
        max_tokens: int = 64,
        format_score: float = 0.0,
        **options: Any,
    ) -> None:
        if verdict not in VERDICTS:
            raise ValueError(f"verdict: {verdict!r}; choose one of {', '.join(VERDICTS)}")
        super().__init__(endpoints, **options)
        self.model, self.template, self.verdict = model, template, verdict
        self.score_max, self.labels = score_max, dict(labels or DEFAULT_LABELS)
        self.max_tokens, self.format_score = max_tokens, format_score

    @staticmethod
    def endpoint_url(endpoint: str) -> str:
        return f"{base_url(endpoint)}/v1/completions"

    def score_batch(self, items: list[dict[str, Any]]) -> list[Any]:
        if not self.model:
            roots = [base_url(replica.url) for replica in self.replicas]
            self.model = first_model(roots, "reward.judge_model", self.timeout_s, self._headers)
        return super().score_batch(items)

    def request_body(self, items: list[dict]) -> dict[str, Any]:
        return {
            "model": self.model,
            "prompt": [render(self.template, item) for item in items],
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
            "n": 1,
        }

    def results(self, answer: httpx.Response, items: list[dict], url: str) -> list[Any]:
        try:
            choices = answer.json()["choices"]
            replies = {int(c["index"]): str(c["text"]) for c in choices}
        except (ValueError, KeyError, TypeError):
            return [VerifierUnavailable(f"{url} answered without completion choices")] * len(items)
        if sorted(replies) != list(range(len(items))):
            return [
                VerifierUnavailable(f"{url} answered {len(replies)} choices for {len(items)}")
            ] * len(items)
        return [self._verdict(replies[index]) for index in range(len(items))]

    def _verdict(self, reply: str) -> dict[str, Any]:
        if self.verdict == "score":
            value = read_score(reply, self.score_max)
        else:
            value = read_label(reply, self.labels)
        if value is None:
            self.last_metrics["reward/judge_format_errors"] += 1
            return {"score": self.format_score, "judge_format_error": 1, "judge_reply": reply[:200]}
        return {"score": value}
