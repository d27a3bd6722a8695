"""Multi-turn rollouts with tools (``rollout.tools``): the policy calls tools mid-answer,
reads their output, and goes on.

``ToolEngine`` wraps any rollout engine. Each sample is generated turn by turn: a turn ends
at the tool-call format's closing tag (a stop token of the call), the turn's calls are parsed
(``calls.parse_tool_calls``) and run on a thread pool, and their responses, rendered as
the chat template renders tool messages (``calls.ToolResponses``), are appended as
tokens; the next turn continues from the prompt and every token so far. Token in, token out:
the sequence trained is exactly the tokens the engine was given and returned, plus the tool
responses' tokens; nothing is decoded and encoded again.

A slow tool does not hold the other samples: while a sample's calls run, the samples whose
calls have returned go on to their next turn in the next engine call; the loop waits for a
call only when no sample can go on without it.

A sample ends at a turn without a call (its answer), at ``max_turns`` (``length``: the last
turn's calls are not run), or at its token budget (``length``; a tool response that does not
fit is not appended, so a response always ends with tokens the model sampled). Partial
rollouts continue a sample by keyed requests (``GenerationRequest.key``): the engine keeps
each sample's turns and calls between calls, and a call adds about a chunk of tokens to each
(a turn cut at the chunk goes on in the next call, under the weights of its time). The tool
responses are recorded as ``Rollout.tool_spans`` (no loss, behaviour logprob 0) and each call
in ``Rollout.tool_calls``; ``take_report`` adds ``tool/*`` metrics. A call's output or error
text is whatever the tool or the model wrote made safe to tokenize (``calls``): no text the
model writes raises out of ``generate``. A mixture-of-experts
policy's routed experts (routing replay R3) are the last turn's: its prompt held every earlier
token, the tool responses too.
"""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, fields, replace
from typing import Any

from honing.errors import ConfigError
from honing.rollout.base import (
    EngineReport,
    GenerationRequest,
    RolloutEngine,
    SamplingParams,
    WeightBuckets,
)
from honing.rollout.tools.calls import (
    TOOL_THREADS,
    ToolResponses,
    ToolResult,
    parse_tool_calls,
    run_call,
    tool_call_format,
)
from honing.rollout.tools.specs import Tool, ToolSettings, build_tools
from honing.seeds import round_seed
from honing.types import Rollout

TOOL_WORKERS = 8  # tool calls running at once


@dataclass
class _Sample:
    """One sample's turns so far."""

    request: GenerationRequest
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)
    calls: list[dict] = field(default_factory=list)
    turns: int = 0
    finish: str | None = None
    waiting: list[Future] = field(default_factory=list)  # its turn's calls, running
    turn_text: str = ""
    experts: Any = None  # the last turn's routed experts: its prompt held every earlier token
    turn_start: int = 0  # where its current turn's tokens start in ``ids``
    limit: int | None = None  # a chunk (keyed request): this call pauses it at this many ids
    paused: bool = False  # at its chunk's end: the next call goes on

    @property
    def active(self) -> bool:
        return self.finish is None and not self.paused


class ToolEngine(RolloutEngine):
    """``inner`` generating multi-turn samples with ``tools`` (see the module).

    Raises (when built):
        ConfigError: the format's closing tag is not one token of ``tokenizer`` (a turn
            must end at a token), or the chat template cannot render tool responses.
    """

    def __init__(
        self, inner: RolloutEngine, tokenizer, settings: ToolSettings, tools: dict[str, Tool]
    ):
        super().__init__(inner.holds)
        self.inner, self.tokenizer = inner, tokenizer
        self.settings, self.tools = settings, tools
        self.format = tool_call_format(settings.tool_format)
        close = tokenizer.encode(self.format.close, add_special_tokens=False)
        if len(close) != 1:
            raise ConfigError(
                f"rollout.tool_format={settings.tool_format}: {self.format.close!r} is "
                f"{len(close)} tokens of this tokenizer; a turn ends at one token (add it as "
                "a special token, as chat models with tools have it)"
            )
        self.close_id = close[0]
        self.responses = ToolResponses(tokenizer)
        self.keeps_kv = False
        self._live: dict[str, _Sample] = {}  # partial rollouts: the samples by key
        self.computes_here = inner.computes_here  # each torchrun rank runs its own turns
        self.shared_by_ranks = inner.shared_by_ranks
        self._report: dict[str, float] = {}

    @property
    def weight_version(self) -> int:  # the inner engine's
        return self.inner.weight_version

    @weight_version.setter
    def weight_version(self, version: int) -> None:
        self.inner.weight_version = version

    @property
    def regenerated(self) -> int:  # the inner engine's (a server's failed requests)
        return self.inner.regenerated

    def load_weights(self, version: int, weights: WeightBuckets | None = None) -> None:
        self.inner.load_weights(version, weights)

    def detached_copy(self) -> ToolEngine:
        return ToolEngine(self.inner.detached_copy(), self.tokenizer, self.settings, self.tools)

    def step_done(self, metrics: dict[str, float]) -> None:
        self.inner.step_done(metrics)

    def close(self) -> None:
        self.inner.close()

    def take_report(self) -> EngineReport:
        """The inner engine's report and the tool metrics of the samples since the last take:
        calls, errors and timeouts (counts; a call refused for want of a free tool thread is
        a timeout), calls and turns per sample, mean call latency; and the process's tool
        threads held now by calls abandoned past their deadline (``calls.TOOL_THREADS``)."""
        metrics, events = self.inner.take_report()
        sums, self._report = self._report, {}
        if sums:
            samples, calls = max(sums["samples"], 1.0), max(sums["calls"], 1.0)
            metrics = metrics | {
                "tool/samples": sums["samples"],
                "tool/calls": sums["calls"],
                "tool/errors": sums["errors"],
                "tool/timeouts": sums["timeouts"],
                "tool/calls_per_sample": sums["calls"] / samples,
                "tool/turns_per_sample": sums["turns"] / samples,
                "tool/latency_s": sums["latency_s"] / calls,
                "tool/hung_threads": float(TOOL_THREADS.hung),
            }
        return metrics, events

    def generate(self, requests: list[GenerationRequest], params: SamplingParams) -> list[Rollout]:
        if any(r.key is not None for r in requests):
            return self._continue(requests, params)
        samples = [_Sample(r) for r in requests for _ in range(params.n)]
        seconds = self._run(samples, params)
        self._count(samples)
        return [self._rollout(s, seconds) for s in samples]

    def _run(self, samples: list[_Sample], params: SamplingParams) -> float:
        """Turns of ``samples`` until each has finished or paused; the seconds it took."""
        started = time.perf_counter()
        with ThreadPoolExecutor(TOOL_WORKERS, thread_name_prefix="honing-tools") as pool:
            calls = 0
            while any(s.active for s in samples):
                for sample in samples:
                    if sample.waiting and all(f.done() for f in sample.waiting):
                        self._answer(sample, params)
                ready = [s for s in samples if s.active and not s.waiting]
                if not ready:  # every unfinished sample waits on a call: wait for one
                    running = [f for s in samples for f in s.waiting]
                    wait(running, return_when=FIRST_COMPLETED)
                    continue
                self._turn(ready, replace(params, seed=round_seed(params.seed, calls)), pool)
                calls += 1
        return time.perf_counter() - started

    def _continue(self, requests: list[GenerationRequest], params: SamplingParams):
        """Partial rollouts: each keyed request continues the sample of its key (its turns,
        calls and the tokens of a turn cut short), or starts one, by about
        ``params.max_new_tokens`` tokens (a turn is cut there; a tool's response is
        appended whole), within ``params.max_seq_len``; each rollout is the part this call
        added. The samples of keys not in the call are let go."""
        if params.n != 1 or any(r.key is None for r in requests):
            raise ValueError("keyed requests are samples to continue: all keyed, n=1")
        live, samples = {}, []
        for r in requests:
            kept = self._live.get(r.key)
            if kept is None or kept.request.prompt_ids + kept.ids != list(r.prompt_ids):
                kept = _Sample(r)
            kept.paused, kept.limit = False, len(kept.ids) + params.max_new_tokens
            live[r.key] = kept
            samples.append(kept)
        self._live = live
        marks = [(len(s.ids), len(s.spans), len(s.calls), s.turns, s.finish) for s in samples]
        seconds = self._run(samples, params)
        self._count([s for s, m in zip(samples, marks, strict=True) if m[4] is None and s.finish])
        return [
            self._piece(r, s, mark, seconds)
            for r, s, mark in zip(requests, samples, marks, strict=True)
        ]

    def _piece(self, request: GenerationRequest, sample: _Sample, mark, seconds: float):
        """What ``sample`` added since ``mark`` (its ids, spans, calls and turns then), as
        the rollout of ``request`` (whose prompt holds every earlier token)."""
        at, spans, calls, turns, _ = mark
        ids = sample.ids[at:]
        return Rollout(
            prompt_id=request.prompt_id,
            group_index=request.group_index,
            prompt_ids=list(request.prompt_ids),
            response_ids=ids,
            behaviour_logprobs=sample.logprobs[at:],
            finish_reason=sample.finish or "length",  # paused: cut at the chunk's length
            weight_version=self.inner.weight_version,
            text=self.tokenizer.decode(ids, skip_special_tokens=True),
            gen_seconds=seconds,
            tool_spans=[(start - at, count) for start, count in sample.spans[spans:]],
            tool_calls=sample.calls[calls:],
            turns=sample.turns - turns,
            routed_experts=sample.experts,
        )

    def _turn(self, ready: list[_Sample], params: SamplingParams, pool) -> None:
        """One engine call: a turn of each of ``ready``; their calls are started on ``pool``."""
        rooms = [self._room(s, params) for s in ready]
        requests = [
            GenerationRequest(s.request.prompt_id, s.request.prompt_ids + s.ids, i)
            for i, s in enumerate(ready)
        ]
        turn = replace(
            params, n=1, max_new_tokens=max(rooms), stop_ids=(*params.stop_ids, self.close_id)
        )
        outs = self.inner.generate(requests, turn)
        for sample, room, out in zip(ready, rooms, outs, strict=True):
            taken = out.response_ids[:room]
            sample.ids += taken
            sample.logprobs += out.behaviour_logprobs[: len(taken)]
            if out.routed_experts is not None:  # prompt + every token so far but the last
                sample.experts = out.routed_experts[
                    : len(sample.request.prompt_ids) + len(sample.ids) - 1
                ]
            sample.turns += 1
            closed = taken[-1:] == [self.close_id]
            if len(taken) < len(out.response_ids) or (not closed and out.finish_reason == "length"):
                if sample.limit is not None and self._budget(sample, params) > 0:
                    sample.paused, sample.turns = True, sample.turns - 1  # goes on next call
                else:  # past its own budget
                    sample.finish = "length"
            elif not closed:  # its answer, or a limit
                sample.finish = out.finish_reason
            elif sample.turns >= self.settings.max_turns:
                sample.finish = "length"  # its last turn: no call runs
            else:
                self._start_calls(sample, sample.ids[sample.turn_start :], pool)

    def _budget(self, sample: _Sample, params: SamplingParams) -> int:
        """Tokens ``sample`` may still take (a chunk's: to ``max_seq_len``)."""
        prompt = len(sample.request.prompt_ids)
        if sample.limit is None:
            return min(params.max_new_tokens, params.max_seq_len - prompt) - len(sample.ids)
        return params.max_seq_len - prompt - len(sample.ids)

    def _room(self, sample: _Sample, params: SamplingParams) -> int:
        """Tokens ``sample`` may take in this call: its budget, and a chunk's limit."""
        if sample.limit is None:
            return self._budget(sample, params)
        return min(self._budget(sample, params), sample.limit - len(sample.ids))

    def _start_calls(self, sample: _Sample, turn_ids: list[int], pool) -> None:
        text = self.tokenizer.decode(turn_ids, skip_special_tokens=False)
        found = parse_tool_calls(text, self.tools, self.format, self.settings.max_tool_calls)
        if not found:  # a closing tag without a call: the turn is the answer
            sample.finish = "stop"
            return
        s = self.settings
        sample.turn_text = text
        sample.waiting = [
            pool.submit(run_call, call, self.tools, s.tool_timeout_s, s.tool_output_bytes)
            for call in found
        ]

    def _answer(self, sample: _Sample, params: SamplingParams) -> None:
        """Appends the responses of ``sample``'s finished calls (or ends it if they do not
        fit in its budget)."""
        results: list[ToolResult] = [f.result() for f in sample.waiting]
        sample.waiting = []
        sample.calls += [
            {
                "name": r.name,
                "latency_s": r.latency_s,
                "error": r.error,
                "timed_out": r.timed_out,
                "truncated": r.truncated,
            }
            for r in results
        ]
        ids = self.responses.ids(sample.turn_text, results)
        if len(ids) >= self._budget(sample, params):  # no room for it and a turn after it
            sample.finish = "length"
            return
        sample.spans.append((len(sample.ids), len(ids)))
        sample.ids += ids
        sample.logprobs += [0.0] * len(ids)
        sample.turn_start = len(sample.ids)
        if sample.limit is not None and len(sample.ids) >= sample.limit:
            sample.paused = True  # the chunk is spent: its next turn comes next call

    def _rollout(self, sample: _Sample, seconds: float) -> Rollout:
        return Rollout(
            prompt_id=sample.request.prompt_id,
            group_index=sample.request.group_index,
            prompt_ids=list(sample.request.prompt_ids),
            response_ids=sample.ids,
            behaviour_logprobs=sample.logprobs,
            finish_reason=sample.finish or "length",
            weight_version=self.inner.weight_version,
            text=self.tokenizer.decode(sample.ids, skip_special_tokens=True),
            gen_seconds=seconds,
            tool_spans=list(sample.spans),
            tool_calls=sample.calls,
            turns=sample.turns,
            routed_experts=sample.experts,
        )

    def _count(self, samples: list[_Sample]) -> None:
        calls = [c for s in samples for c in s.calls]
        add = {
            "calls": float(len(calls)),
            "errors": float(sum(c["error"] for c in calls)),
            "timeouts": float(sum(c["timed_out"] for c in calls)),
            "latency_s": sum(c["latency_s"] for c in calls),
            "turns": float(sum(s.turns for s in samples)),
            "samples": float(len(samples)),
        }
        for key, value in add.items():
            self._report[key] = self._report.get(key, 0.0) + value


def merge_tool_metrics(reports: list[dict[str, float]]) -> dict[str, float]:
    """Several turn loops' ``tool/*`` metrics (the ranks', the workers') as one: counts
    summed, the per-sample and per-call figures weighted by the samples and calls behind them,
    hung threads the most any process holds."""
    parts = [m for m in reports if m.get("tool/samples")]
    if not parts:
        return {}
    total = {k: sum(m[f"tool/{k}"] for m in parts) for k in ("samples", "calls", "errors")}
    total["timeouts"] = sum(m["tool/timeouts"] for m in parts)
    turns = sum(m["tool/turns_per_sample"] * m["tool/samples"] for m in parts)
    latency = sum(m["tool/latency_s"] * max(m["tool/calls"], 1.0) for m in parts)
    calls = max(total["calls"], 1.0)
    return {f"tool/{k}": v for k, v in total.items()} | {
        "tool/calls_per_sample": total["calls"] / total["samples"],
        "tool/turns_per_sample": turns / total["samples"],
        "tool/latency_s": latency / calls if total["calls"] else 0.0,
        "tool/hung_threads": max(m["tool/hung_threads"] for m in parts),
    }


TOOL_OPEN, TOOL_CLOSE = "[tool output]", "[/tool output]"


def tool_record(rollout: Rollout, tokenizer) -> dict:
    """What ``samples.jsonl`` and the report show of a multi-turn sample: its turns and calls,
    and the response with each tool response between ``TOOL_OPEN`` and ``TOOL_CLOSE`` (the
    model's turns and the tool's output told apart); nothing for a one-turn sample."""
    if rollout.tool_calls is None:
        return {}
    ids, parts, at = rollout.response_ids, [], 0
    for start, count in rollout.tool_spans or ():
        parts.append(tokenizer.decode(ids[at:start], skip_special_tokens=False))
        output = tokenizer.decode(ids[start : start + count], skip_special_tokens=False)
        parts.append(f"{TOOL_OPEN}{output}{TOOL_CLOSE}")
        at = start + count
    parts.append(tokenizer.decode(ids[at:], skip_special_tokens=False))
    calls = rollout.tool_calls
    return {
        "response": "".join(parts),
        "turns": rollout.turns,
        "tool_calls": len(calls),
        "tool_errors": sum(c["error"] for c in calls),
        "tool_latency_s": round(sum(c["latency_s"] for c in calls), 4),
    }


def with_tools(engine: RolloutEngine, local: RolloutEngine, tokenizer, rollout) -> tuple:
    """``engine`` and the validation engine ``local`` generating multi-turn samples with the
    tools ``rollout`` (the ``rollout`` config) names; ``local`` once when it is ``engine``."""
    keys = {f.name: getattr(rollout, f.name) for f in fields(ToolSettings)}  # the same names
    settings = ToolSettings(**keys | {"tools": tuple(rollout.tools)})
    tools = build_tools(settings.tools)
    wrapped = ToolEngine(engine, tokenizer, settings, tools)
    if engine is local:
        return wrapped, wrapped
    return wrapped, ToolEngine(local, tokenizer, settings, tools)
