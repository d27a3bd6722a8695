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
  ordered prompt by prompt, ``n`` each. The answer also says ``weight_version``.
- ``POST /update_weights_from_disk`` ``{"model_path": DIR, "version": V}``: loads the
  safetensors weights of a checkpoint or model directory (SGLang's endpoint name and body).
- ``POST /update_weights?version=V``: a safetensors file as the body (weights sent over HTTP).
- ``GET /health``, ``GET /v1/models``.
- ``GET /metrics``: speculative decoding's counters (when started with ``--speculative``), under
  vLLM's names: ``vllm:spec_decode_num_drafts_total``, ``..._num_draft_tokens_total``,
  ``..._num_accepted_tokens_total``.

With ``--token``, every endpoint needs ``Authorization: Bearer TOKEN`` (401 without it) except
``GET /health``, which answers a bare ``{"status": "ok"}`` without it (for load balancers and
container health checks) and its details (model, weight version, counters) with it. A body
that is not a JSON object, or is nested too deeply to parse, is a 400 naming the problem.

One generation runs at a time (the engine batches each request's prompts); requests wait
their turn on a thread, so health checks answer while a batch generates.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from honing.rollout.base import GenerationRequest, SamplingParams

_UNAUTHORISED = "missing or wrong bearer token (Authorization: Bearer ...)"


class BadRequest(ValueError):
    """A request the server cannot serve; the message names the field."""


def sampling_from_request(body: dict[str, Any], max_seq_len: int) -> SamplingParams:
    """The OpenAI/vLLM sampling fields of ``body`` as honing's ``SamplingParams``."""

    def number(key: str, default, kind=float):
        value = body.get(key, default)
        if value is None:
            return default
        try:
            return kind(value)
        except (TypeError, ValueError):
            raise BadRequest(f"{key}: expected a number, got {value!r}") from None

    temperature = number("temperature", 1.0)
    top_k = number("top_k", -1, int)
    n = number("n", 1, int)
    if n < 1:
        raise BadRequest(f"n: expected >= 1, got {n}")
    return SamplingParams(
        n=n,
        max_new_tokens=max(number("max_tokens", 16, int), 1),
        max_seq_len=max_seq_len,
        temperature=temperature if temperature > 0 else 1.0,
        top_k=max(top_k, 0),
        top_p=number("top_p", 1.0),
        greedy=temperature <= 0,
        seed=number("seed", 0, int),
    )


def prompts_from_request(body: dict[str, Any], tokenizer) -> list[list[int]]:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        prompt = [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise BadRequest("prompt: expected token ids, a list of them, or text")
    rows = []
    for item in prompt:
        if isinstance(item, str):
            rows.append(tokenizer(item, add_special_tokens=False)["input_ids"])
        elif isinstance(item, list) and item and all(isinstance(t, int) for t in item):
            rows.append(item)
        else:
            raise BadRequest(f"prompt: expected token ids or text, got {str(item)[:60]!r}")
    return rows


async def json_object(request: Request) -> dict[str, Any]:
    """The request's body as a JSON object.

    Raises:
        BadRequest: not JSON, nested too deeply to parse, or not an object.
    """
    try:
        body = json.loads(await request.body())
    except (ValueError, UnicodeDecodeError) as err:
        raise BadRequest(f"body: not JSON ({err})") from None
    except RecursionError:
        raise BadRequest("body: nested too deeply to parse") from None
    if not isinstance(body, dict):
        raise BadRequest("body: expected a JSON object")
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


def rollout_app(
    engine,
    *,
    model_name: str,
    max_seq_len: int = 4096,
    token: str = "",
    max_body_bytes: int = 4 << 30,
    exit_after: int = 0,
) -> FastAPI:
    """The app over an in-process ``engine`` (a ``TransformersEngine``).

    ``exit_after`` (fault injection): the process dies, without answering, on that
    completion request, as a crashed or preempted engine would."""
    app = FastAPI(title="honing rollout", docs_url=None, redoc_url=None)
    turn = threading.Lock()  # one generation or weight load at a time
    expected_auth = f"Bearer {token}".encode()
    counters = {"requests": 0, "completions": 0, "errors": 0}
    # Speculative decoding, under vLLM's counter names so that one client reads both.
    speculation = {"drafts": 0.0, "draft_tokens": 0.0, "accepted_tokens": 0.0}

    def refuse(code: int, message: str) -> JSONResponse:
        counters["errors"] += 1
        return JSONResponse({"error": {"message": message, "code": code}}, status_code=code)

    def authorised(request: Request) -> bool:
        given = request.headers.get("authorization", "").encode()
        return not token or hmac.compare_digest(given, expected_auth)

    def complete(body: dict[str, Any]) -> dict[str, Any]:
        rows = prompts_from_request(body, engine.tokenizer)
        params = sampling_from_request(body, max_seq_len)
        requests = [GenerationRequest(str(i), ids, i) for i, ids in enumerate(rows)]
        with turn:
            rollouts = engine.generate(requests, params)
            version = engine.weight_version
            take_report = getattr(engine, "take_report", None)
            metrics = take_report()[0] if take_report is not None else {}
            for key in speculation:
                speculation[key] += metrics.get(f"rollout/spec_{key}", 0.0)
        order = sorted(range(len(rollouts)), key=lambda i: rollouts[i].group_index)
        choices = []
        for index, position in enumerate(order):
            r = rollouts[position]
            choices.append(
                {
                    "index": index,
                    "text": r.text,
                    "token_ids": r.response_ids,
                    "finish_reason": r.finish_reason,
                    "logprobs": {
                        "tokens": [f"token_id:{t}" for t in r.response_ids],
                        "token_logprobs": r.behaviour_logprobs,
                        "top_logprobs": None,
                    },
                }
            )
        routed = _routed_experts(rollouts, order, choices)
        completion_tokens = sum(len(c["token_ids"]) for c in choices)
        prompt_tokens = sum(len(ids) for ids in rows)
        return routed | {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": model_name,
            "choices": choices,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
            "weight_version": version,
        }

    def load(path: Path | None, data: bytes | None, version: int) -> None:
        from safetensors.torch import load, load_file

        if path is not None:
            shards = sorted(path.glob("*.safetensors"))
            if not shards:
                raise BadRequest(f"model_path: no *.safetensors files in {path}")
            weights = {}
            for shard in shards:
                weights.update(load_file(shard))
        else:
            try:
                weights = load(data)
            except Exception as err:  # noqa: BLE001 - any parse failure is the client's
                raise BadRequest(f"body: not a safetensors file ({err})") from None
        model = engine.model
        own = model.state_dict()
        unknown = sorted(set(weights) - set(own))
        if unknown:
            raise BadRequest(f"weights do not fit the served model: unknown {unknown[:3]}")
        with turn:
            for name, tensor in weights.items():
                own[name].copy_(tensor.to(own[name].dtype))
            engine.weight_version = version

    async def run(function, *args):
        return await asyncio.get_running_loop().run_in_executor(None, function, *args)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        if not authorised(request):
            return refuse(401, _UNAUTHORISED)
        lines = []
        for key, value in speculation.items():
            name = f"vllm:spec_decode_num_{key}_total"
            lines += [f"# TYPE {name} counter", f'{name}{{model_name="{model_name}"}} {value}']
        return PlainTextResponse("\n".join(lines) + "\n")

    @app.post("/v1/completions")
    async def completions(request: Request) -> JSONResponse:
        if not authorised(request):
            return refuse(401, _UNAUTHORISED)
        counters["requests"] += 1
        if exit_after and counters["requests"] >= exit_after:
            os._exit(17)
        try:
            answer = await run(complete, await json_object(request))
        except (BadRequest, ValueError) as err:
            return refuse(400, str(err))
        counters["completions"] += len(answer["choices"])
        return JSONResponse(answer)

    @app.post("/update_weights_from_disk")
    async def from_disk(request: Request) -> JSONResponse:
        if not authorised(request):
            return refuse(401, _UNAUTHORISED)
        try:
            body = await json_object(request)
            path = Path(str(body.get("model_path", "")))
            if not path.is_dir():
                raise BadRequest(f"model_path: {path} is not a directory on the server")
            version = int(body.get("version", engine.weight_version + 1))
            await run(load, path, None, version)
        except (BadRequest, ValueError) as err:
            return refuse(400, str(err))
        return JSONResponse({"success": True, "weight_version": version})

    @app.post("/update_weights")
    async def from_body(request: Request) -> JSONResponse:
        if not authorised(request):
            return refuse(401, _UNAUTHORISED)
        declared = int(request.headers.get("content-length") or 0)
        if declared > max_body_bytes:
            return refuse(413, f"body of {declared} bytes is over the {max_body_bytes} limit")
        try:
            version = int(request.query_params.get("version", engine.weight_version + 1))
            await run(load, None, await request.body(), version)
        except (BadRequest, ValueError) as err:
            return refuse(400, str(err))
        return JSONResponse({"success": True, "weight_version": version})

    @app.get("/health")
    async def health(request: Request) -> dict[str, Any]:
        if not authorised(request):
            return {"status": "ok"}
        return {
            "status": "ok",
            "service": "rollout",
            "model": model_name,
            "weight_version": engine.weight_version,
            "fast_decode": engine.fast_decode_reason,
            **counters,
        }

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        if not authorised(request):
            return refuse(401, _UNAUTHORISED)
        return JSONResponse({"object": "list", "data": [{"id": model_name, "object": "model"}]})

    return app
