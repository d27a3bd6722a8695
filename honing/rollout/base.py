"""The rollout-engine protocol: what the loop asks of anything that samples completions."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

from honing.seeds import task_seed
from honing.types import Rollout

# Weights as rollout engines receive them: buckets of (name, tensor) pieces, each of at most
# rollout.weight_bucket_mb (a larger tensor alone), made by the trainer engine as they are
# asked for, so that a large model is never copied whole to be sent.
WeightBucket = list[tuple[str, Any]]
WeightBuckets = Iterable[WeightBucket]
EngineReport = tuple[dict[str, float], list[tuple[str, dict]]]


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
        stop_ids: token ids that end a response besides the engine's own end-of-sequence
            ones (a tool call's closing tag); a response ended by one counts as ``stop``.
        first_index: the position of the call's first request in the call it was cut from
            (``chunked``), for an engine that ``seeds_by_index``.
    """

    n: int = 1
    max_new_tokens: int = 16
    max_seq_len: int = 512
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    greedy: bool = False
    seed: int = 0
    stop_ids: tuple[int, ...] = ()
    first_index: int = 0


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt to complete: its id, its token ids, and the group slot it fills.

    ``key`` names a sample that later calls continue (partial rollouts): an engine that
    ``keeps_kv`` keeps the KV cache of a keyed request it ended at its length limit, and a
    later request with the same key whose ids extend that sample's goes on from it instead of
    computing the cache again. A call drops what it did not use or keep."""

    prompt_id: str
    prompt_ids: list[int]
    group_index: int
    key: str | None = None


@dataclass
class WeightStream:
    """Weight buckets to load (iterating it gives ``buckets``), and ``again``: how to make the
    same weights again later, for an engine that may have to send them once more (a server
    that comes back holding other weights), or None. ``again`` holds no copy of its own: it
    reads the live module (valid while the trainer keeps these weights) or a snapshot kept
    anyway."""

    buckets: WeightBuckets
    again: Callable[[], WeightBuckets] | None = None

    def __iter__(self) -> Iterator[WeightBucket]:
        return iter(self.buckets)


class Holding(Enum):
    """What policy an engine samples with, and so how it takes new weights."""

    SHARED = "shared"  # the trainer's module itself, in this process: only the version changes
    COPY = "copy"  # its own copy of the policy module in this process: the module's tensors
    REMOTE = "remote"  # a plain model in other processes or servers: plain weights (LoRA merged)


class RolloutEngine(ABC):
    """Samples completions and receives new policy weights; every engine of the pipeline
    (in-process, torchrun-spread, Ray workers, remote servers) subclasses it, and one that
    lacks a required method fails when it is built.

    ``holds`` (a constructor argument): what the engine samples with (``Holding``).
    ``generate`` returns ``n`` rollouts per request, grouped by request, in request order.
    ``load_weights`` makes the engine sample from policy ``version`` from now on: a
    ``SHARED`` engine only records the version; any other needs the weights, as buckets of
    (name, tensor) pieces (``COPY``: the policy module's own names, a LoRA wrapper's included;
    ``REMOTE``: the plain model's, a LoRA policy's adapters merged), taken one bucket at a time
    and let go before the next is asked for (the next may reuse the memory: a bucket's tensors
    are valid only until then). ``detached_copy`` gives an engine that can
    sample on another thread while the trainer's module changes (itself, for engines in other
    processes). ``take_report`` hands over the metrics and events of the calls since the last
    take; ``regenerated`` counts samples generated again after a worker or server failed;
    ``step_done`` hands over each training step's metrics; ``close`` releases connections and
    workers.

    ``computes_here``: it generates with this process's own compute (honing's engine, vLLM
    in process), so that under torchrun every rank's engine can take a share of a call; not
    an engine whose work is done elsewhere (servers, Ray workers). ``seeds_by_index``: each
    request is sampled from the call's seed and its index in the whole call
    (``SamplingParams.first_index`` plus its position), so the tasks ``chunked`` cuts from a
    call sample what the whole call would, whichever process runs each. ``shared_by_ranks``:
    how many consecutive torchrun ranks run the engine together (vLLM tensor-parallel over
    them), each of which must make the same calls.
    """

    weight_version: int = 0  # the policy version it samples from
    regenerated: int = 0
    keeps_kv: bool = False  # continues keyed requests from their kept cache (see the request)
    computes_here: bool = True
    seeds_by_index: bool = False
    shared_by_ranks: int = 1

    def __init__(self, holds: Holding) -> None:
        self.holds = holds

    @abstractmethod
    def generate(
        self, requests: list[GenerationRequest], params: SamplingParams
    ) -> list[Rollout]: ...

    @abstractmethod
    def load_weights(self, version: int, weights: WeightBuckets | None = None) -> None: ...

    @abstractmethod
    def detached_copy(self) -> RolloutEngine: ...

    def take_report(self) -> EngineReport:
        return {}, []

    def step_done(self, metrics: dict[str, float]) -> None:
        """A training step's finished metrics (its timings among them), handed over by the
        loop once a step ends: an engine may adjust itself for the next steps (the Ray
        backend's rollout workers scale with where the step waited). Nothing by default; a
        wrapper hands them to the engine it wraps."""
        return None

    def close(self) -> None:
        return None


def chunked(
    requests: list[GenerationRequest], params: SamplingParams, size: int, by_index: bool = False
) -> list[tuple[list[GenerationRequest], SamplingParams]]:
    """``requests`` as tasks of ``size`` prompts, each with a seed of its own derived from
    its position: the samples of a task do not depend on which worker or rank runs it. With
    ``by_index`` (an engine that ``seeds_by_index``), each task keeps the call's seed and
    says where it starts, so the tasks together sample what the whole call would."""

    def params_of(start: int) -> SamplingParams:
        if by_index:
            return replace(params, first_index=params.first_index + start)
        return replace(params, seed=task_seed(params.seed, start))

    return [
        (requests[start : start + size], params_of(start))
        for start in range(0, len(requests), size)
    ]
