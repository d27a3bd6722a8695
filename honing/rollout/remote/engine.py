"""A rollout engine on remote servers that speak the OpenAI-compatible completions API with
token ids and logprobs: vLLM, SGLang, or ``honing serve rollout``.

Each prompt's group is one request (``n = group_size``, the prompt sent as token ids), spread
over the endpoints round-robin, several at once. Every choice must give its token ids
(``token_ids``, or ``logprobs.tokens`` as ``"token_id:N"``, which vLLM returns with
``return_tokens_as_token_ids``) and the sampling logprob of each token
(``logprobs.token_logprobs``); the engine asks for both.

Start-up: the engine is made only once every endpoint answers, takes the token, serves the
policy and tokenizes as its tokenizer does, and a ``weight_dir`` is writable
(``honing.rollout.remote.checks``); otherwise a ``UserError`` says what to fix.

Failures: a request that fails (connection refused or reset, timeout, HTTP 5xx or 429) is
retried on another endpoint, up to ``retries`` times; the failing endpoint is set aside for
``cooldown_s`` and comes back after a successful ``GET /health``. The samples of a failed
request are generated again elsewhere and counted (``regenerated``); when no endpoint is left
the call raises ``EngineUnavailable`` naming each endpoint's last error. A 4xx answer (a bad
request) is not retried: it raises at once with the server's message.

Weights: ``load_weights(version, weights)`` has the sender of ``weight_sync``
(``honing.rollout.remote.senders``; vLLM's RL API: ``honing.rollout.remote.vllm_sender``) send them,
bucket by bucket, to every endpoint that is up; one that comes back holding other weights (a
server whose ``/health`` does not say which it holds may) is sent the newest before it serves
a request, or, when the sender cannot make them again, serves nothing until the next sync.

One trainer at a time: a server that took this engine's weights holds to it (and refuses
another trainer's) until the engine closes (``honing.rollout.remote.hold``).

Routing replay (R3) of a mixture-of-experts policy: with ``routing`` set, each rollout carries
the experts the server's routers chose, in vLLM's or SGLang's form
(``honing.rollout.remote.routed_experts``); against a server that routes only a response's first
choice (SGLang's ``sglext``) the engine asks for each sample of a group in a request of its
own.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx

from honing.rollout.base import (
    GenerationRequest,
    Holding,
    RolloutEngine,
    SamplingParams,
    WeightBuckets,
)
from honing.rollout.remote import http as openai_http
from honing.rollout.remote.checks import check_servers, check_weight_dir
from honing.rollout.remote.hold import TRAINER_HEADER, Keeper, lapses_in
from honing.rollout.remote.http import (
    Endpoint,
    EngineRequestError,
    EngineUnavailable,
    Retryable,
    WeightsRefused,
    base_url,
)
from honing.rollout.remote.routed_experts import (
    RoutingShape,
    routed_experts,
    routes_first_choice_only,
)
from honing.rollout.remote.senders import make_sender
from honing.rollout.remote.vllm_sender import VLLMWeightSender
from honing.seeds import request_seed
from honing.types import Rollout

__all__ = ["EngineRequestError", "EngineUnavailable", "OpenAIEngine"]


class OpenAIEngine(RolloutEngine):
    """Samples completions from OpenAI-compatible completion servers (see the module).

    Args:
        endpoints: base URLs (``http://host:port``; a trailing ``/v1`` is accepted).
        tokenizer: the policy's tokenizer (decodes text when a server omits it).
        model: the served model name; default: the first of ``GET /v1/models``.
        timeout_s: per request. retries: other endpoints tried for a failed request.
        max_concurrency: requests in flight at once. token: bearer token, if the servers
            require one. stop_ids: token ids that end a response (counted as ``stop``).
        routing: for R3, the policy's routers; the engine then asks for routed experts.

    The servers hold their own plain copies of the model (``Holding.REMOTE``).
    """

    def __init__(
        self,
        endpoints: list[str],
        tokenizer,
        *,
        model: str = "",
        timeout_s: float = 600.0,
        retries: int = 2,
        max_concurrency: int = 16,
        cooldown_s: float = 5.0,
        token: str = "",
        stop_ids: set[int] | None = None,
        weight_sync: str = "tensors",
        weight_dir: str = "",
        model_dir: str = "",
        spec_metrics: bool = False,
        routing: RoutingShape | None = None,
    ):
        if not endpoints:
            raise ValueError("rollout.endpoints is empty; give at least one server URL")
        super().__init__(Holding.REMOTE)
        self.computes_here = False  # the servers generate
        self.endpoints = [Endpoint(base_url(url)) for url in endpoints]
        self.tokenizer = tokenizer
        self.retries, self.cooldown_s = retries, cooldown_s
        self.stop_ids = stop_ids or {tokenizer.eos_token_id}
        self.trainer = uuid.uuid4().hex[:16]  # this trainer, for the servers' hold
        headers = {TRAINER_HEADER: self.trainer}
        headers |= {"Authorization": f"Bearer {token}"} if token else {}
        self.client = httpx.Client(timeout=timeout_s, headers=headers)
        self.pool = ThreadPoolExecutor(max_concurrency, thread_name_prefix="honing-openai")
        self.weight_sync = weight_sync
        self.sender = (  # vLLM's sender builds on senders: it cannot be made there
            VLLMWeightSender(self._post, self._get, weight_dir)
            if weight_sync == "vllm"
            else make_sender(weight_sync, self._post, weight_dir, model_dir)
        )
        self._turn = itertools.count()
        self._lock = threading.Lock()
        self._sync_lock = threading.Lock()  # one weight upload at a time
        self._keeper = Keeper(self, OpenAIEngine._renew)  # the servers that hold to it
        if weight_sync == "disk":
            check_weight_dir(weight_dir)
        self.model = check_servers(
            self.client,
            [e.url for e in self.endpoints],
            tokenizer,
            model=model,
            model_dir=model_dir,
            token=token,
            weight_sync=weight_sync,
        )
        self.spec_metrics = spec_metrics  # read the servers' speculative-decoding counters
        self._spec_seen: dict[str, dict[str, float]] = {}  # endpoint -> counters last read
        self.routing = routing
        # set on the first answer that routes only its first choice (SGLang's sglext)
        self.one_sample_per_request = False

    # -- sampling -------------------------------------------------------------------------

    def generate(self, requests: list[GenerationRequest], params: SamplingParams) -> list[Rollout]:
        started = time.perf_counter()
        futures = [
            self.pool.submit(self._complete, request, params, index)
            for index, request in enumerate(requests)
        ]
        choices = [future.result() for future in futures]
        seconds = time.perf_counter() - started
        rollouts = []
        for request, (group, version, routes) in zip(requests, choices, strict=True):
            for choice, routed in zip(group, routes, strict=True):
                rollouts.append(self._rollout(request, choice, version, seconds, routed))
        return rollouts

    def _payload(self, request: GenerationRequest, params: SamplingParams, index: int) -> dict:
        budget = min(params.max_new_tokens, params.max_seq_len - len(request.prompt_ids))
        if budget < 1:
            raise ValueError(
                f"prompt {request.prompt_id} has {len(request.prompt_ids)} tokens; "
                f"rollout.max_seq_len is {params.max_seq_len} (raise it or shorten the prompt)"
            )
        return {
            "model": self.model,
            "prompt": list(request.prompt_ids),
            "n": params.n,
            "max_tokens": budget,
            "temperature": 0.0 if params.greedy else params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k if params.top_k > 0 else -1,
            "seed": request_seed(params.seed, index, params.n),  # per prompt, reproducible
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
            "skip_special_tokens": False,
            "stop_token_ids": sorted(self.stop_ids | set(params.stop_ids)),
        } | ({"return_routed_experts": True} if self.routing is not None else {})

    def _complete(self, request: GenerationRequest, params: SamplingParams, index: int):
        """One prompt's group: (choices, weight version, each choice's routed experts)."""
        if self.one_sample_per_request and params.n > 1:
            return self._complete_one_by_one(request, params, index)
        payload = self._payload(request, params, index)
        answer, version = self._answer(request, payload, params.n)
        routes = [self._routed(request, answer, c) for c in answer["choices"]]
        if params.n > 1 and routes_first_choice_only(answer):
            self.one_sample_per_request = True  # SGLang: its sglext has the first choice's
            return self._complete_one_by_one(request, params, index)
        return answer["choices"], version, routes

    def _complete_one_by_one(self, request, params: SamplingParams, index: int):
        """The group as ``n`` requests of one sample each, seeded apart."""
        choices, routes, version = [], [], self.weight_version
        for sample in range(params.n):
            payload = self._payload(request, params, index) | {"n": 1}
            payload["seed"] = request_seed(payload["seed"], sample)
            answer, version = self._answer(request, payload, 1)
            choices += answer["choices"]
            routes.append(self._routed(request, answer, answer["choices"][0]))
        return choices, version, routes

    def _routed(self, request: GenerationRequest, answer: dict, choice: dict):
        return routed_experts(self.routing, len(request.prompt_ids), answer, choice)

    def _answer(self, request: GenerationRequest, payload: dict, n: int):
        errors = []
        for attempt in range(self.retries + 1):
            endpoint = self._pick()
            try:
                answer = self._post(endpoint, "/v1/completions", json=payload)
            except Retryable as err:
                errors.append(f"{endpoint.url}: {err}")
                self._set_aside(endpoint, str(err))
                continue
            if attempt:
                with self._lock:
                    self.regenerated += n
            choices = answer.get("choices") or []
            if len(choices) != n:
                raise EngineRequestError(
                    f"{endpoint.url} answered {len(choices)} choices for n={n}"
                )
            return answer, answer.get("weight_version", self.weight_version)
        raise EngineUnavailable(
            f"no rollout endpoint could serve prompt {request.prompt_id} after "
            f"{self.retries + 1} attempts: " + "; ".join(errors)
        )

    def _rollout(
        self,
        request: GenerationRequest,
        choice: dict,
        version: int,
        seconds: float,
        routed=None,
    ):
        ids = choice.get("token_ids")
        logprobs = choice.get("logprobs") or {}
        if ids is None:
            ids = [_token_id(token) for token in logprobs.get("tokens") or []]
        values = logprobs.get("token_logprobs")
        if values is None or len(values) != len(ids):
            raise EngineRequestError(
                "a completion came without a logprob per token; the server must return "
                "logprobs.token_logprobs (request logprobs=0)"
            )
        reason = choice.get("finish_reason") or "length"
        if reason not in ("stop", "length"):
            reason = "abort"
        text = choice.get("text")
        if text is None:
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return Rollout(
            prompt_id=request.prompt_id,
            group_index=request.group_index,
            prompt_ids=list(request.prompt_ids),
            response_ids=[int(i) for i in ids],
            behaviour_logprobs=[float(v) for v in values],
            finish_reason=reason,
            weight_version=int(version),
            text=text,
            gen_seconds=seconds,
            routed_experts=routed,
        )

    def take_report(self) -> tuple[dict[str, float], list]:
        """With ``spec_metrics``: the acceptance the servers report for the calls since the
        last take, from vLLM's spec-decode counters at ``GET /metrics`` (``honing serve
        rollout`` exposes the same): ``rollout/spec_accept_rate`` (accepted / draft tokens)
        and ``rollout/spec_accepted_len`` (accepted tokens per draft)."""
        if not self.spec_metrics:
            return {}, []
        totals = dict.fromkeys(SPEC_COUNTERS, 0.0)
        for endpoint in self.endpoints:
            if endpoint.down_until > time.monotonic():
                continue
            try:
                response = self.client.get(endpoint.url + "/metrics")
            except httpx.HTTPError:
                continue
            if response.status_code != 200:
                continue
            now = _counters(response.text)
            before = self._spec_seen.get(endpoint.url, dict.fromkeys(SPEC_COUNTERS, 0.0))
            self._spec_seen[endpoint.url] = now
            for key in SPEC_COUNTERS:  # a restarted server starts its counters from 0
                totals[key] += now[key] - before[key] if now[key] >= before[key] else now[key]
        if not totals["draft_tokens"]:
            return {}, []
        return {
            "rollout/spec_accept_rate": totals["accepted_tokens"] / totals["draft_tokens"],
            "rollout/spec_accepted_len": totals["accepted_tokens"] / max(totals["drafts"], 1.0),
        }, []

    # -- weights --------------------------------------------------------------------------

    def load_weights(self, version: int, weights: WeightBuckets | None = None) -> None:
        """Has every endpoint sample from ``weights`` from now on, sent bucket by bucket by
        the sender of ``weight_sync`` (``honing.rollout.remote.senders``).

        An endpoint that is down is set aside; when it is back it is sent the newest weights
        before it serves a request, if the sender can send them again (``disk``, or
        ``tensors`` given a ``WeightStream`` with ``again``), else it waits for the next
        sync. When no endpoint takes them, ``EngineUnavailable``; when one refuses them
        (HTTP 4xx: they do not fit its model), ``WeightsRefused``: each a ``UserError``."""
        if weights is None:  # nothing to send: the version is all that moves
            for endpoint in self.endpoints:
                endpoint.version = version
            self.weight_version = version
            return
        now = time.monotonic()
        down = [e for e in self.endpoints if e.down_until > now]  # synced when it is back
        errors = [f"{e.url}: set aside ({e.last_error})" for e in down]
        with self._sync_lock:
            live = [e for e in self.endpoints if e not in down]
            self._hold(live)
            try:
                failures = self.sender.send(live, version, weights)
            except EngineRequestError as err:  # the weights do not fit a server's model
                raise WeightsRefused(f"the new weights were refused: {err}") from None
            for endpoint, error in failures:
                errors.append(f"{endpoint.url}: {error}")
                self._set_aside(endpoint, error)
        if len(errors) == len(self.endpoints):
            raise EngineUnavailable(
                "no rollout endpoint took the new weights: " + "; ".join(errors)
            )
        self.weight_version = version

    def detached_copy(self) -> OpenAIEngine:
        """Itself: the servers' models are not the trainer's, so sampling on another thread
        needs no copy."""
        return self

    def close(self) -> None:
        """Lets go of the servers that held to this trainer, and of the connections."""
        held = self._keeper.close()
        for endpoint in self.endpoints:
            if endpoint.url in held:
                with contextlib.suppress(Retryable, EngineRequestError):
                    self.sender.release(endpoint, self.trainer)
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()

    def _hold(self, endpoints: list[Endpoint]) -> None:
        """Has each of ``endpoints`` take weights from this trainer alone, before anything is
        sent (``honing.rollout.remote.hold``); one that is down is left to the sync.

        Raises:
            WeightsRefused: a server holds to another trainer.
        """
        for endpoint in endpoints:
            try:
                held = self._hold_one(endpoint)
            except Retryable:
                continue
            except EngineRequestError as err:
                raise WeightsRefused(
                    f"rollout.endpoints: {endpoint.url} takes weights from another trainer: {err}"
                ) from None
            if held:
                self._keeper.add(endpoint.url)

    def _hold_one(self, endpoint: Endpoint) -> bool:
        """``sender.hold``, asked again once the hold of a trainer that fell silent lapses."""
        try:
            return self.sender.hold(endpoint, self.trainer)
        except EngineRequestError as err:
            wait = lapses_in(str(err))
            if wait is None:
                raise
        time.sleep(wait)
        return self.sender.hold(endpoint, self.trainer)

    def _renew(self, url: str) -> None:
        """The keeper's renewal of the hold of the server at ``url``."""
        endpoint = next(e for e in self.endpoints if e.url == url)
        self.sender.renew(endpoint, self.trainer)

    # -- endpoints ------------------------------------------------------------------------

    def _pick(self) -> Endpoint:
        """The next endpoint in turn that is not set aside and has the newest weights; one set
        aside whose cool-down is over comes back once ``/health`` answers and it has taken the
        newest weights (a restarted server starts from its own)."""
        now = time.monotonic()
        count = len(self.endpoints)
        start = next(self._turn)
        for offset in range(count):
            endpoint = self.endpoints[(start + offset) % count]
            if endpoint.down_until > now or (endpoint.failures and not self._healthy(endpoint)):
                continue
            if endpoint.version != self.weight_version:
                with self._sync_lock:
                    try:
                        self._hold([endpoint])
                        if not self.sender.catch_up(endpoint):
                            continue  # behind: the next sync brings it up to date
                    except Retryable as err:
                        self._set_aside(endpoint, str(err))
                        continue
                    except EngineRequestError as err:
                        raise WeightsRefused(f"the newest weights were refused: {err}") from None
            return endpoint
        raise EngineUnavailable(
            "every rollout endpoint is down: "
            + "; ".join(f"{e.url} ({e.last_error})" for e in self.endpoints)
        )

    def _healthy(self, endpoint: Endpoint) -> bool:
        try:
            answer = self._get(endpoint, "/health")
        except (Retryable, EngineRequestError) as err:
            self._set_aside(endpoint, str(err))
            return False
        # honing's server says which weights it holds; another may have restarted with its own
        endpoint.version = int(answer["weight_version"]) if "weight_version" in answer else -1
        endpoint.failures = 0
        return True

    def _set_aside(self, endpoint: Endpoint, error: str) -> None:
        with self._lock:
            endpoint.failures += 1
            endpoint.last_error = error
            endpoint.down_until = time.monotonic() + self.cooldown_s

    def _get(self, endpoint: Endpoint, path: str) -> dict:
        return openai_http.request(self.client, "GET", endpoint, path)

    def _post(self, endpoint: Endpoint, path: str, **kwargs) -> dict:
        return openai_http.request(self.client, "POST", endpoint, path, **kwargs)


SPEC_COUNTERS = ("drafts", "draft_tokens", "accepted_tokens")


def _counters(text: str) -> dict[str, float]:
    """vLLM's spec-decode counters in a Prometheus text page, summed over their labels."""
    totals = dict.fromkeys(SPEC_COUNTERS, 0.0)
    names = {f"vllm:spec_decode_num_{key}_total": key for key in SPEC_COUNTERS}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        value = line.rsplit(" ", 1)[-1]
        if name in names:
            with contextlib.suppress(ValueError):  # a malformed line counts nothing
                totals[names[name]] += float(value)
    return totals


def _token_id(token: str) -> int:
    if isinstance(token, str) and token.startswith("token_id:"):
        return int(token.split(":", 1)[1])
    raise EngineRequestError(
        f"a completion gave token {token!r} without its id; start vLLM with "
        "--return-tokens-as-token-ids or use a server that returns token_ids"
    )
