"""The rollout-engine protocol: what the loop asks of anything that samples completions."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

from honing.types import Rollout


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. ``greedy`` ignores temperature, top-k and top-p.

    Attributes:
        n: completions per prompt (the GRPO group size).
        max_new_tokens: response tokens at most, before ``max_seq_len`` also caps it.
        max_seq_len: prompt + response tokens at most.
        top_k: keep the k most likely tokens (0 = off).
        top_p: keep the smallest set of tokens whose probability reaches p (1.0 = off).
        seed: seeds this call's sampling, so a step's rollouts do not depend on history.
    """

    n: int = 1
    max_new_tokens: int = 16
    max_seq_len: int = 512
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    greedy: bool = False
    seed: int = 0


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt to complete: its id, its token ids, and the group slot it fills."""

    prompt_id: str
    prompt_ids: list[int]
    group_index: int


class RolloutEngine(Protocol):
    """Samples completions and receives new policy weights.

    ``generate`` returns ``n`` rollouts per request, grouped by request, in request order.
    ``load_weights`` makes the engine sample from policy ``version`` from now on; an engine
    that shares the trainer's module in-process (``shares_policy``) only records the version,
    any other needs ``state_dict`` (an engine in other processes holds the plain model: a
    LoRA policy's adapters come merged, ``components.engine_weights``). ``detached_copy``
    gives an engine that can sample on another thread while the trainer's module changes
    (itself, for remote engines).
    """

    shares_policy: bool
    weight_version: int

    def detached_copy(self) -> RolloutEngine: ...

    def generate(
        self, requests: list[GenerationRequest], params: SamplingParams
    ) -> list[Rollout]: ...

    def load_weights(self, version: int, state_dict: dict | None = None) -> None: ...


def chunked(
    requests: list[GenerationRequest], params: SamplingParams, size: int
) -> list[tuple[list[GenerationRequest], SamplingParams]]:
    """``requests`` as tasks of ``size`` prompts, each with a seed of its own derived from
    its position: the samples of a task do not depend on which worker or rank runs it."""
    return [
        (
            requests[start : start + size],
            replace(params, seed=(params.seed * 1_000_003 + start) % (2**63)),
        )
        for start in range(0, len(requests), size)
    ]
