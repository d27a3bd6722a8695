"""Partial rollouts (``schedule.partial_rollout``, under ``schedule.mode=async``): a step's
batch does not wait for its longest samples, and new weights reach the engine mid-sample.

The generation thread keeps a pool of groups in flight, up to twice ``rollout.batch_size``
(no more than the batches up to their deadline can take: a group must be trained within
``schedule.max_staleness`` of its first token's version), and samples them in chunks of
``schedule.partial_chunk_tokens`` tokens: one engine call continues every unfinished sample
by a chunk (its prompt and the tokens it has so far are the call's prompt). With
``schedule.partial_kv=recompute`` the KV cache of those tokens is computed afresh under the
weights the engine holds; with ``keep`` each sample is a keyed request
(``GenerationRequest.key``) and the engine goes on from the cache it kept from the last
chunk, made by the weights of its time. Between chunks the engine loads the
newest published weights, so an update reaches the samples at the next chunk's first
token. A step's batch is ``batch_size`` groups whose samples have all finished, the
earliest deadlines first; the others stay in the pool and go on with the next weights.
Every token keeps the version that produced it (``Rollout.version_spans``) and the logprob
it was sampled with, so the loss corrects each token against the trainer's own
(``algorithm.tis_level``); a sample's staleness is its oldest token's. When a batch is due,
the samples that could not wait for a later one without going stale are ended where they
are, as ``abort``, and trained in it.

What the pool holds is regenerated after a resume: the checkpoint's data cursor lists the
prompts drawn but not yet trained (``PromptSource`` serves them first), so none is lost or
trained twice.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from honing.errors import ConfigError
from honing.rollout.base import GenerationRequest
from honing.rollout.tools.turns import ToolEngine
from honing.seeds import round_seed
from honing.types import Prompt, Rollout

POOL_BATCHES = 2  # groups in flight at most: this many batches' worth


@dataclass
class Sample:
    """One sample in flight: its tokens so far, their logprobs and versions."""

    group: int
    index: int = 0  # in its group
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    spans: list[list[int]] = field(default_factory=list)  # [version, tokens] in order
    finish: str | None = None
    # with tools: the tool responses' (start, tokens) in ids, the calls and the turns
    tool_spans: list[tuple[int, int]] = field(default_factory=list)
    tool_calls: list[dict] | None = None
    turns: int = 0
    experts: Any = None  # routing replay R3: the experts of every input token so far

    @property
    def oldest(self) -> int | None:
        return self.spans[0][0] if self.spans else None

    def extend(self, rollout: Rollout, version: int, room: int, chunk: int) -> None:
        """Add a chunk's ``rollout`` made by weights ``version``, at most ``room`` tokens
        (``chunk``: the tokens the call asked for; a sample cut at its length with fewer
        reached its end)."""
        ids = rollout.response_ids[:room]
        start = len(self.ids)
        self.ids += ids
        self.logprobs += rollout.behaviour_logprobs[: len(ids)]
        if ids:
            if self.spans and self.spans[-1][0] == version:
                self.spans[-1][1] += len(ids)
            else:
                self.spans.append([version, len(ids)])
        if rollout.tool_calls is not None:  # a tool response cut by the room is cut here too
            self.tool_calls = (self.tool_calls or []) + rollout.tool_calls
            self.turns += rollout.turns
            for at, count in rollout.tool_spans or ():
                if at < len(ids):
                    self.tool_spans.append((start + at, min(count, len(ids) - at)))
        if rollout.routed_experts is not None:  # this chunk's, after the tokens known before
            self.experts = _stitched(self.experts, rollout, len(ids))
        cut = rollout.finish_reason == "length" and len(rollout.response_ids) >= chunk
        if rollout.finish_reason in ("stop", "abort") and len(ids) == len(rollout.response_ids):
            self.finish = rollout.finish_reason
        elif len(ids) >= room or (rollout.finish_reason == "length" and not cut):
            self.finish = "length"


def _stitched(before, rollout: Rollout, added: int):
    """A sample's routed experts (a row per input token: its prompt and every response token
    but the last) after a chunk that kept ``added`` of ``rollout``'s tokens: the rows it had,
    each from the pass that sampled the token after it, then the chunk's own rows for the
    tokens after them (the chunk's prompt ends with the last token sampled before it)."""
    rows = rollout.routed_experts
    end = len(rollout.prompt_ids) + max(added - 1, 0)
    if before is None:
        return rows[:end]
    return torch.cat([before, rows[len(before) : end]])


@dataclass
class Group:
    prompt: Prompt
    samples: list[Sample]
    seconds: float = 0.0

    @property
    def done(self) -> bool:
        return all(s.finish is not None for s in self.samples)

    @property
    def oldest(self) -> int:
        return min((s.oldest for s in self.samples if s.oldest is not None), default=1 << 62)


class PartialPool:
    """The groups in flight (see the module).

    Args:
        parts: the run's components (the producer's engine, prompt ids, tokenizer).
        group_size, batch_size: of the run (``rollout``).
        chunk_tokens: tokens per sample per engine call.
        max_staleness: ``schedule.max_staleness``.
        keep_kv: ``schedule.partial_kv=keep``: continue samples from the engine's kept cache.
    """

    def __init__(
        self,
        parts,
        *,
        group_size: int,
        batch_size: int,
        chunk_tokens: int,
        max_staleness: int,
        keep_kv: bool = False,
    ):
        if keep_kv and not parts.engine.keeps_kv:
            raise ConfigError(
                "schedule.partial_kv=keep needs an engine that keeps a sample's KV cache: "
                "vLLM in process, or honing's engine on its fast decode path (a Llama-family "
                "policy, rollout.fast_decode on, no rollout.speculative); use "
                "schedule.partial_kv=recompute"
            )
        self.parts = parts
        self.group_size, self.batch_size = group_size, batch_size
        self.chunk_tokens, self.max_staleness = chunk_tokens, max_staleness
        self.keep_kv = keep_kv
        self.groups: list[Group] = []
        self._numbers = 0
        self.calls = 0

    def room(self, step: int, version: int) -> int:
        """Prompts to draw while step ``step``'s batch is made with weights ``version``: up
        to ``POOL_BATCHES`` batches' worth of groups, and no more than the batches from this
        step to the new groups' deadline can train (a group started now, carried past it,
        would be dropped as stale)."""
        deadline = version + self.max_staleness + 1
        slots = max(0, deadline - step + 1) * self.batch_size
        return max(0, min(POOL_BATCHES * self.batch_size, slots) - len(self.groups))

    def add(self, prompts: list[Prompt]) -> None:
        for prompt in prompts:
            self.groups.append(
                Group(prompt, [Sample(self._numbers, k) for k in range(self.group_size)])
            )
            self._numbers += 1

    def prompts(self) -> list[Prompt]:
        """The prompts of every group held (drawn and not yet handed on)."""
        return [group.prompt for group in self.groups]

    def ready(self) -> int:
        return sum(group.done for group in self.groups)

    def chunk(self, seed: int) -> None:
        """Continue every unfinished sample by one chunk with the engine's weights."""
        engine, sampling = self.parts.engine, self.parts.train_sampling
        todo = [(g, s) for g in self.groups for s in g.samples if s.finish is None]
        if not todo:
            return
        keyed = self.keep_kv or isinstance(engine, ToolEngine)  # it keeps the turns too
        requests = [
            GenerationRequest(
                g.prompt.id,
                self.parts.prompt_ids[g.prompt.id] + s.ids,
                i,
                key=f"{s.group}/{s.index}" if keyed else None,
            )
            for i, (g, s) in enumerate(todo)
        ]
        chunk = replace(
            sampling,
            n=1,
            max_new_tokens=self.chunk_tokens,
            seed=round_seed(seed, self.calls),
        )
        self.calls += 1
        started = time.perf_counter()
        rollouts = engine.generate(requests, chunk)
        seconds = time.perf_counter() - started
        version = engine.weight_version
        for (group, sample), rollout in zip(todo, rollouts, strict=True):
            prompt_len = len(self.parts.prompt_ids[group.prompt.id])
            room = min(
                sampling.max_new_tokens - len(sample.ids),
                sampling.max_seq_len - prompt_len - len(sample.ids),
            )
            sample.extend(rollout, version, room, self.chunk_tokens)
        for group in {id(g): g for g, _ in todo}.values():
            group.seconds += seconds

    def deadline(self, group: Group) -> int:
        """The last step that may train ``group`` within ``max_staleness``."""
        return group.oldest + self.max_staleness + 1

    def end_stale(self, step: int) -> int:
        """When step ``step``'s batch is due: end, as ``abort``, the samples of the groups
        that cannot wait for a later batch (their deadline is this step), and of those due
        next step when they would not all fit in it; returns how many samples."""
        due = [g for g in self.groups if self.deadline(g) <= step]
        upcoming = [g for g in self.groups if self.deadline(g) == step + 1]
        if len(due) + len(upcoming) > self.batch_size:
            due += upcoming
        ended = 0
        for group in due:
            for sample in group.samples:
                if sample.finish is None:
                    sample.finish, ended = "abort", ended + 1
        return ended

    def take(self) -> list[Group]:
        """``batch_size`` finished groups, the earliest deadlines first (removed)."""
        done = sorted((g for g in self.groups if g.done), key=self.deadline)
        taken = done[: self.batch_size]
        self.groups = [g for g in self.groups if all(g is not t for t in taken)]
        return taken

    def rollouts(self, groups: list[Group], version: int) -> list[Rollout]:
        """The finished ``groups`` as rollouts, group ``i`` of the batch as group index i (a
        sample with no token takes ``version``, the engine's)."""
        tokenizer = self.parts.tokenizer
        out = []
        for index, group in enumerate(groups):
            prompt_ids = self.parts.prompt_ids[group.prompt.id]
            for sample in group.samples:
                out.append(
                    Rollout(
                        prompt_id=group.prompt.id,
                        group_index=index,
                        prompt_ids=list(prompt_ids),
                        response_ids=sample.ids,
                        behaviour_logprobs=sample.logprobs,
                        finish_reason=sample.finish,
                        weight_version=sample.oldest if sample.spans else version,
                        text=tokenizer.decode(sample.ids, skip_special_tokens=True),
                        gen_seconds=group.seconds,
                        version_spans=[tuple(span) for span in sample.spans],
                        routed_experts=sample.experts,
                        tool_spans=list(sample.tool_spans)
                        if sample.tool_calls is not None
                        else None,
                        tool_calls=sample.tool_calls,
                        turns=sample.turns if sample.tool_calls is not None else 1,
                    )
                )
        return out

    def in_flight(self) -> int:
        """Samples held and not finished."""
        return sum(s.finish is None for g in self.groups for s in g.samples)
