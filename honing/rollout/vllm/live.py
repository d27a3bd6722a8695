"""Samples kept alive in vLLM between generate calls: partial rollouts with
``schedule.partial_kv=keep`` on vLLM in process.

A keyed request (``GenerationRequest.key``) becomes a vLLM request that the call does not
finish: the call steps vLLM's engine until each of its requests has made the chunk's tokens
(``SamplingParams.max_new_tokens``) or ended, hands those tokens over, and leaves the request
in vLLM's scheduler with its KV cache. New weights load between calls; the next call with the
same key (its ids: the earlier ones and the tokens handed over) steps the same request on,
over the cache the older weights made. A call aborts the live requests it does not continue.

vLLM's prefix cache must be off for this (``VLLMSettings.prefix_caching``): its blocks cannot
be dropped while requests hold them, and a new prompt would be served the old weights'
keys and values.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from honing.rollout.base import GenerationRequest, SamplingParams
from honing.seeds import request_seed


@dataclass
class _Live:
    request_id: str
    ids: list[int]  # the prompt and every token handed over so far
    seen: int = 0  # output tokens handed over


@dataclass
class Made:
    """What a call made for one request: its new tokens, their logprobs, and why it stopped
    (``length`` when the chunk was cut and the request goes on)."""

    ids: list[int]
    logprobs: list[float]
    finish: str


class LiveRequests:
    """The keyed requests alive in ``llm``'s engine (see the module). ``sampling(params,
    max_tokens, seed)`` makes a request's vLLM sampling parameters."""

    def __init__(self, llm, sampling):
        self.llm, self.sampling = llm, sampling
        self.live: dict[str, _Live] = {}
        self._numbers = itertools.count()
        self.kept_tokens = 0  # cache tokens continued requests went on from

    def generate(
        self, requests: list[GenerationRequest], params: SamplingParams, limit: int
    ) -> list[Made]:
        """One chunk for each of ``requests`` (keyed, n=1), in order; ``limit``: prompt and
        response tokens at most."""
        from vllm.inputs import TokensPrompt

        engine = self.llm.llm_engine
        wanted = {r.key: r for r in requests}
        self.drop([k for k, live in self.live.items() if live.ids != _ids(wanted.get(k))])
        self.kept_tokens += sum(len(self.live[r.key].ids) for r in requests if r.key in self.live)
        for index, r in enumerate(requests):
            if r.key not in self.live:
                request_id = f"honing-live-{next(self._numbers)}"
                budget = min(params.max_seq_len, limit) - len(r.prompt_ids)
                seed = request_seed(params.seed, params.first_index + index)
                prompt = TokensPrompt(prompt_token_ids=list(r.prompt_ids))
                engine.add_request(request_id, prompt, self.sampling(params, budget, seed))
                self.live[r.key] = _Live(request_id, list(r.prompt_ids))
        mine = {self.live[r.key].request_id: self.live[r.key] for r in requests}
        latest: dict[str, object] = {}
        chunk = params.max_new_tokens
        while not all(_enough(latest.get(i), live, chunk) for i, live in mine.items()):
            if not engine.has_unfinished_requests():
                break
            for output in engine.step():
                if output.request_id in mine:
                    latest[output.request_id] = output
        return [self._hand_over(r.key, latest.get(self.live[r.key].request_id)) for r in requests]

    def _hand_over(self, key: str, output) -> Made:
        live = self.live[key]
        if output is None:  # nothing came (a request vLLM could not schedule)
            raise RuntimeError(f"vLLM returned nothing for the live request {key}")
        completion = output.outputs[0]
        ids = list(completion.token_ids[live.seen :])
        entries = completion.logprobs[live.seen :]
        logprobs = [entry[token].logprob for entry, token in zip(entries, ids, strict=True)]
        live.seen += len(ids)
        live.ids += ids
        if not output.finished:
            return Made(ids, logprobs, "length")
        del self.live[key]
        reason = completion.finish_reason
        if reason == "error":
            raise RuntimeError(f"vLLM failed while completing the live request {key}")
        return Made(ids, logprobs, reason if reason in ("stop", "length") else "abort")

    def drop(self, keys: list[str] | None = None) -> None:
        """Aborts the live requests of ``keys`` (all when None)."""
        keys = list(self.live) if keys is None else keys
        gone = [self.live.pop(k).request_id for k in keys if k in self.live]
        if gone:
            self.llm.llm_engine.abort_request(gone)


def _ids(request: GenerationRequest | None) -> list[int] | None:
    return None if request is None else list(request.prompt_ids)


def _enough(output, live: _Live, chunk: int) -> bool:
    """Whether a request's latest ``output`` ended it or made ``chunk`` tokens this call."""
    if output is None:
        return False
    return output.finished or len(output.outputs[0].token_ids) - live.seen >= chunk
