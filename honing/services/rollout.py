"""``honing serve rollout``: honing's rollout engine behind the OpenAI-compatible completions
API that vLLM and SGLang servers expose, plus weight updates, so that remote rollout engines
(``rollout.engine=openai``) are tested end to end on loopback.

Endpoints:
- ``POST /v1/completions``: ``prompt`` as token ids (``[int]`` or ``[[int], ...]``) or text
  (``str`` or ``[str]``), ``n``, ``max_tokens``, ``temperature`` (0 = greedy), ``top_p``,
  ``top_k`` (vLLM's extension; -1 or 0 = off), ``seed``, ``logprobs``. Each choice carries
  ``token_ids`` (as vLLM's ``return_token_ids``), ``logprobs.tokens`` as ``"token_id:N"``
  (as vLLM's ``return_tokens_as_token_ids``), ``logprobs.token_logprobs`` (the sampling
  logprob of each token), ``finish_reason`` (``stop`` | ``length``) and ``text``; choices are
  ordered prompt by prompt, ``n`` each. The answer also says ``weight_version``. With
  ``prompt_logprobs: 0`` (vLLM's extension) each choice also carries its prompt's
  ``prompt_logprobs``: ``None`` for the first token, then for each token ``{id: {"logprob",
  "rank", "decoded_token"}}``, the model's own logprob of that token after the ones before it
  (not scaled by ``temperature``): what a teacher's logprobs of a student's sample are read
  from.
- ``POST /update_weights_from_disk`` ``{"model_path": DIR, "version": V}``: loads the
  safetensors weights of a checkpoint or model directory (SGLang's endpoint name and body).
- ``POST /update_weights?version=V``: a safetensors file as the body (weights sent over HTTP).
- ``POST /update_weights/bucket?update=ID&part=K``: bucket ``K`` (0, 1, ...) of update ``ID``
  (the client's name for it, letters, digits, ``-`` and ``_``), a safetensors body, checked and
  staged; ``POST /update_weights/commit?update=ID&parts=N&version=V`` applies the ``N``
  buckets staged as version ``V``, all at once. Nothing of an update is served before its
  commit: a refused bucket drops it, and one left unfinished (its client gone) is replaced by
  the next update's first bucket.
- ``POST /update_weights/hold``, ``/update_weights/release``: the trainer named in the
  ``X-Honing-Trainer`` header takes (or renews) the server's hold, or lets go of it; while a
  trainer holds the server, a weight update from any other is a 409
  (``honing.rollout.remote.hold``).
- ``POST /tokenize`` ``{"prompt": TEXT, "add_special_tokens": bool}``: ``{"tokens", "count",
  "max_model_len"}``, as vLLM and SGLang answer it (clients check that their tokenizer is the
  server's).
- ``GET /health``, ``GET /v1/models`` (each model's ``id``, the directory it was loaded from as
  ``root``, and ``max_model_len``, as vLLM and SGLang list them).
- ``GET /metrics``: the request counters of every honing service, and speculative decoding's
  (when started with ``--speculative``) under vLLM's names:
  ``vllm:spec_decode_num_drafts_total``, ``..._num_draft_tokens_total``,
  ``..._num_accepted_tokens_total``.

Bounds (the server has no token by default, so whoever reaches it may send anything): a
completion request may ask for at most ``--max-sequences`` completions (prompts times ``n``,
default 1024) of at most ``--max-tokens`` tokens each (default 4096), and each prompt must
leave room for a response under ``--max-seq-len`` (default 4096); token ids (a prompt's and
at most 1,024 ``stop_token_ids``) must be in the model's vocabulary; text must be valid Unicode;
numbers must be finite and in range (``honing.services.completion_request``).
A JSON body is at most 64 MiB. Anything past these is a 400 (413 for a body) naming the field.
A weight update is checked tensor by tensor against the served model and applied all at once
or not at all, in one request or bucket by bucket (``honing.services.rollout_weights``).

With ``--token``, every endpoint needs ``Authorization: Bearer TOKEN`` (401 without it) except
``GET /health``, which answers a bare ``{"status": "ok"}`` without it (for load balancers and
container health checks) and its details (model, weight version, counters) with it: the
guards of ``honing.services.app.create_app``, which builds this app. A body that is not a JSON
object, or is nested too deeply to parse, is a 400 naming the problem.

One generation runs at a time (the engine batches each request's prompts); requests wait
their turn on a thread, so health checks answer while a batch generates.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from prometheus_client.metrics_core import CounterMetricFamily

from honing.rollout.base import GenerationRequest
from honing.services.app import Refused, create_app, read_body
from honing.services.completion_request import (
    encode,
    field,
    prompts_from_request,
    sampling_from_request,
)
from honing.services.options import NON_NEGATIVE, CompletionLimits
from honing.services.rollout_weights import (
    TRAINER_HEADER,
    Holder,
    Staged,
    check_complete,
    check_weights,
    from_body,
    from_directory,
    hold_for,
)

MAX_JSON_BYTES = 64 << 20
_SPEC_HELP = {
    "drafts": "speculative decoding rounds that proposed draft tokens",
    "draft_tokens": "draft tokens proposed",
    "accepted_tokens": "draft tokens accepted",
}
_UPDATE_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


def openai_error(code: int, message: str) -> dict[str, Any]:
    """A refusal's body as OpenAI-compatible servers give it."""
    return {"error": {"message": message, "code": code}}


async def json_object(request: Request) -> dict[str, Any]:
    """The request's body as a JSON object.

    Raises:
        Refused: over ``MAX_JSON_BYTES`` (413), not JSON, nested too deeply to parse, or not
            an object.
    """
    try:
        body = json.loads(await read_body(request, MAX_JSON_BYTES))
    except (ValueError, UnicodeDecodeError) as err:
        raise Refused(f"body: not JSON ({err})") from None
    except RecursionError:
        raise Refused("body: nested too deeply to parse") from None
    if not isinstance(body, dict):
        raise Refused("body: expected a JSON object")
    return body


def _routed_experts(rollouts, order: list[int], choices: list[dict]) -> dict[str, Any]:
    """A mixture-of-experts policy's routing, as vLLM's ``--enable-return-routed-experts``
    returns it: ``prompt_routed_experts`` [P, layers, top_k] for the request's prompt and, per
    choice, ``routed_experts`` for its tokens (each but the last: the last was never run)."""
    if not rollouts or rollouts[0].routed_experts is None:
        return {}
    prompt = len(rollouts[0].prompt_ids)
    for choice, position in zip(choices, order, strict=True):
        choice["routed_experts"] = rollouts[position].routed_experts[prompt:].tolist()
    return {"prompt_routed_experts": rollouts[0].routed_experts[:prompt].tolist()}


class _Served:
    """What the routes share: the engine, taken by one generation or weight load at a time,
    its bounds and its counters."""

    def __init__(self, engine, model_name: str, limits: CompletionLimits) -> None:
        self.engine, self.model_name, self.limits = engine, model_name, limits
        self.turn = threading.Lock()
        self.staged = Staged()  # an update arriving bucket by bucket
        self.holder = Holder()  # the trainer whose weights it takes
        self.counters = {"requests": 0, "completions": 0}
        # Speculative decoding, under vLLM's counter names so that one client reads both.
        self.speculation = {"drafts": 0.0, "draft_tokens": 0.0, "accepted_tokens": 0.0}

    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        """A completion request's answer (every field checked before anything runs)."""
        engine = self.engine
        vocab_size = engine.model.get_input_embeddings().num_embeddings
        params = sampling_from_request(body, self.limits, vocab_size)
        rows = prompts_from_request(body, engine.tokenizer, vocab_size, self.limits, params.n)
        wants_prompt_logprobs = _prompt_logprobs_asked(body)
        requests = [GenerationRequest(str(i), ids, i) for i, ids in enumerate(rows)]
        with self.turn:
            rollouts = engine.generate(requests, params)  # the request was checked above
            scored = [self._prompt_logprobs(ids) for ids in rows] if wants_prompt_logprobs else None
            version = engine.weight_version
            metrics = engine.take_report()[0]
            for key in self.speculation:
                self.speculation[key] += metrics.get(f"rollout/spec_{key}", 0.0)
            self.counters["completions"] += len(rollouts)
        order = sorted(range(len(rollouts)), key=lambda i: rollouts[i].group_index)
        choices = [_choice(index, rollouts[position]) for index, position in enumerate(order)]
        if scored is not None:  # each choice its prompt's (choices go prompt by prompt)
            for choice, position in zip(choices, order, strict=True):
                choice["prompt_logprobs"] = scored[rollouts[position].group_index]
        routed = _routed_experts(rollouts, order, choices)
        completion_tokens = sum(len(c["token_ids"]) for c in choices)
        prompt_tokens = sum(len(ids) for ids in rows)
        return routed | {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
            "weight_version": version,
        }

    def _prompt_logprobs(self, ids: list[int]) -> list[dict | None]:
        """The model's logprob (and rank) of each token of ``ids`` after those before it, in
        vLLM's ``prompt_logprobs`` form."""
        model, tokenizer = self.engine.model, self.engine.tokenizer
        device = next(model.parameters()).device
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids], device=device)).logits[0, :-1].float()
        logprobs = logits.log_softmax(-1)
        chosen = torch.tensor(ids[1:], device=device)
        values = logprobs.gather(-1, chosen[:, None])[:, 0]
        ranks = (logprobs > values[:, None]).sum(-1) + 1
        out: list[dict | None] = [None]
        for token, value, rank in zip(ids[1:], values.tolist(), ranks.tolist(), strict=True):
            decoded = tokenizer.decode([token])
            out.append({str(token): {"logprob": value, "rank": rank, "decoded_token": decoded}})
        return out

    def load(self, read, source, version: int, whole: bool = False) -> None:
        """The weights ``read(source)`` gives, checked (``whole``: every weight of the
        model), then applied as ``version``."""
        weights = read(source)
        own = self.engine.model.state_dict()
        check_weights(weights, own)
        if whole:
            check_complete(weights, own)
        with self.turn:
            self.engine.load_weights(version, [list(weights.items())])

    def stage(self, update: str, part: int, data: bytes) -> int:
        """Bucket ``part`` of ``update`` checked and staged; the buckets staged so far."""
        return self.staged.add(update, part, data, self.engine.model.state_dict())

    def commit(self, update: str, parts: int, version: int) -> None:
        """The ``parts`` buckets staged for ``update``, applied as ``version``."""
        weights = self.staged.take(update, parts)
        with self.turn:
            self.engine.load_weights(version, [list(weights.items())])

    def next_version(self, value) -> int:
        """A weight update's ``version`` (default: the served one plus one)."""
        default = self.engine.weight_version + 1
        return field({"version": value}, "version", default, NON_NEGATIVE, integer=True)

    def tokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise Refused("prompt: expected text")
        special = bool(body.get("add_special_tokens", True))
        tokens = encode(self.engine.tokenizer, prompt, "prompt", add_special_tokens=special)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": self.limits.max_seq_len}

    def models(self) -> dict[str, Any]:
        root = getattr(getattr(self.engine, "model", None), "name_or_path", "") or self.model_name
        model = {"id": self.model_name, "object": "model", "root": str(root)}
        return {"object": "list", "data": [model | {"max_model_len": self.limits.max_seq_len}]}

    def health(self) -> dict[str, Any]:
        return {
            "model": self.model_name,
            "weight_version": self.engine.weight_version,
            "fast_decode": self.engine.fast_decode_reason,
            **self.counters,
        }

    def collect(self) -> Iterator[CounterMetricFamily]:
        """Speculative decoding's counters for ``GET /metrics``, under vLLM's names."""
        for key, value in self.speculation.items():
            name = f"vllm:spec_decode_num_{key}"  # the exposition adds _total
            counter = CounterMetricFamily(name, _SPEC_HELP[key], labels=["model_name"])
            counter.add_metric([self.model_name], value)
            yield counter


def _prompt_logprobs_asked(body: dict[str, Any]) -> bool:
    """Whether ``body`` asks for its prompts' logprobs (``prompt_logprobs: 0``).

    Raises:
        Refused: another value (top alternatives per prompt token are not served)."""
    value = body.get("prompt_logprobs")
    if value is None:
        return False
    if isinstance(value, bool) or value != 0:
        raise Refused(
            f"prompt_logprobs: {value!r}; this server gives each prompt token's own logprob "
            "(prompt_logprobs: 0), no top alternatives"
        )
    return True


def _update_query(request: Request, count: str) -> tuple[str, int]:
    """A bucketed update's ``update`` id and its ``count`` field (``part`` or ``parts``).

    Raises:
        Refused: either is missing or malformed.
    """
    update = request.query_params.get("update", "")
    if not _UPDATE_ID.fullmatch(update):
        raise Refused("update: expected 1..64 letters, digits, '-' or '_'")
    value = request.query_params.get(count)
    if value is None:
        raise Refused(f"{count}: missing")
    return update, field({count: value}, count, 0, NON_NEGATIVE, integer=True)


def _choice(index: int, rollout) -> dict[str, Any]:
    return {
        "index": index,
        "text": rollout.text,
        "token_ids": rollout.response_ids,
        "finish_reason": rollout.finish_reason,
        "logprobs": {
            "tokens": [f"token_id:{t}" for t in rollout.response_ids],
            "token_logprobs": rollout.behaviour_logprobs,
            "top_logprobs": None,
        },
    }


def rollout_app(
    engine,
    *,
    model_name: str,
    limits: CompletionLimits | None = None,
    token: str = "",
    max_body_bytes: int = 4 << 30,
    exit_after: int = 0,
) -> FastAPI:
    """The app over an in-process ``engine`` (a ``TransformersEngine``), under the bounds of
    the module docstring.

    ``exit_after`` (fault injection): the process dies, without answering, on that
    completion request, as a crashed or preempted engine would."""
    served = _Served(engine, model_name, limits or CompletionLimits())
    app = create_app(
        service="rollout",
        health=served.health,
        token=token,
        error_body=openai_error,
        collectors=[served],
    )

    async def run(function, *args):
        return await asyncio.get_running_loop().run_in_executor(None, function, *args)

    @app.post("/v1/completions")
    async def completions(request: Request) -> JSONResponse:
        served.counters["requests"] += 1
        if exit_after and served.counters["requests"] >= exit_after:
            os._exit(17)
        return JSONResponse(await run(served.complete, await json_object(request)))

    @app.post("/update_weights_from_disk")
    async def from_disk(request: Request) -> JSONResponse:
        body = await json_object(request)
        path = Path(str(body.get("model_path", "")))
        if not path.is_dir():
            raise Refused(f"model_path: {path} is not a directory on the server")
        version = served.next_version(body.get("version"))
        hold_for(served.holder, request.headers)
        await run(served.load, from_directory, path, version, True)
        return JSONResponse({"success": True, "weight_version": version})

    @app.post("/update_weights")
    async def from_request(request: Request) -> JSONResponse:
        version = served.next_version(request.query_params.get("version"))
        hold_for(served.holder, request.headers)
        data = await read_body(request, max_body_bytes)
        await run(served.load, from_body, data, version)
        return JSONResponse({"success": True, "weight_version": version})

    @app.post("/update_weights/bucket")
    async def stage_bucket(request: Request) -> JSONResponse:
        update, part = _update_query(request, "part")
        hold_for(served.holder, request.headers)
        data = await read_body(request, max_body_bytes)
        staged = await run(served.stage, update, part, data)
        return JSONResponse({"success": True, "staged": staged})

    @app.post("/update_weights/commit")
    async def commit(request: Request) -> JSONResponse:
        update, parts = _update_query(request, "parts")
        version = served.next_version(request.query_params.get("version"))
        hold_for(served.holder, request.headers)
        await run(served.commit, update, parts, version)
        return JSONResponse({"success": True, "weight_version": version})

    @app.post("/update_weights/hold")
    async def hold(request: Request) -> JSONResponse:
        hold_for(served.holder, request.headers)
        return JSONResponse({"success": True, "hold_s": served.holder.hold_s})

    @app.post("/update_weights/release")
    async def release(request: Request) -> JSONResponse:
        served.holder.release(request.headers.get(TRAINER_HEADER, ""))
        return JSONResponse({"success": True})

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        return JSONResponse(served.tokenize(await json_object(request)))

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(served.models())

    return app
