"""In-process rollout engine on a transformers causal LM, with its own sampling loop.

The loop (prefill, then one token at a time with the model's KV cache) is written here rather
than calling ``model.generate`` so that the logprob of each sampled token is taken from exactly
the distribution it was sampled from (after temperature, top-k and top-p) and so that one
``torch.Generator`` per call makes a step's samples independent of anything run before it.
The engine shares the policy module with the trainer: new weights need no copy.

For Llama-family models the forward passes go through ``fast_decode.FastDecoder`` (the same
arithmetic without the Hugging Face per-call overhead, several times faster per token on small
models); any other model, or ``fast_decode=False``, uses the model's own forward and KV cache.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import time
from dataclasses import dataclass

import torch

from honing.models.moe import routers_of
from honing.rollout.base import (
    EngineReport,
    GenerationRequest,
    Holding,
    RolloutEngine,
    SamplingParams,
    WeightBuckets,
)
from honing.rollout.native.fast_decode import FastDecoder, supports
from honing.rollout.native.sampling import filter_logits, sample_categorical
from honing.rollout.native.speculative import (
    SpecStats,
    Speculation,
    merge_metrics,
    speculative_decode,
)
from honing.types import Rollout


def stop_token_ids(model, tokenizer) -> set[int]:
    """EOS of the tokenizer and of the model's generation config (chat models often end a turn
    with a token other than the tokenizer's EOS, e.g. ``<|im_end|>``)."""
    ids = {tokenizer.eos_token_id}
    generation = getattr(model, "generation_config", None)
    extra = getattr(generation, "eos_token_id", None)
    ids.update(extra if isinstance(extra, (list, tuple)) else [extra] if extra is not None else [])
    return {int(i) for i in ids if i is not None}


def _left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
        mask[i, width - len(row) :] = 1
    return ids, mask


class _HFDecoder:
    """Prefill and decode steps through the model's own forward and KV cache (any causal LM)."""

    def __init__(self, model, cache_arg: str):
        self.model, self.cache_arg = model, cache_arg

    def prefill(self, ids, mask, positions, max_new_tokens: int) -> torch.Tensor:
        self.mask = mask
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        self.cache = out.get(self.cache_arg)
        return out.logits[:, -1, :]  # [B, V]

    def step(self, token: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=-1)
        out = self.model(
            input_ids=token[:, None],
            attention_mask=self.mask,
            position_ids=positions,
            use_cache=True,
            **{self.cache_arg: self.cache},
        )
        self.cache = out.get(self.cache_arg)
        return out.logits[:, -1, :]


class TransformersEngine(RolloutEngine):
    """Batched sampling from a Hugging Face causal LM held in this process.

    ``fast_decode`` (default on) uses ``FastDecoder`` when ``supports(model)``; otherwise, and
    when off, the model's own forward. ``fast_decode_reason`` says which and why. ``holds``:
    ``Holding.SHARED`` when ``model`` is the trainer's policy module itself (it then only
    learns each new version), else ``COPY`` (it copies the weights it is sent).
    """

    def __init__(
        self,
        model,
        tokenizer,
        *,
        device: torch.device,
        holds: Holding = Holding.COPY,
        generation_batch: int = 256,
        fast_decode: bool = True,
        speculation: Speculation | None = None,
        gen_timeout_s: float = 0.0,
    ):
        if tokenizer.pad_token_id is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
            raise ValueError("the tokenizer needs a pad token distinct from eos")
        if holds is Holding.REMOTE:
            raise ValueError("a TransformersEngine holds its model in this process")
        super().__init__(holds)
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        self.generation_batch = generation_batch
        self.stop_ids = stop_token_ids(model, tokenizer)
        # The KV cache argument: `cache` from transformers 5.24, `past_key_values` before.
        forward_args = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in forward_args else "past_key_values"
        self.fast_decode_reason = supports(model) if fast_decode else "disabled"
        self.fast_decode = self.fast_decode_reason is True
        self.speculation = speculation
        self.gen_timeout_s = gen_timeout_s  # per generation batch; 0 = none
        if speculation is not None and not self.fast_decode:
            raise ValueError(
                "rollout.speculative needs the fast decode path (rollout.fast_decode=true and "
                f"a Llama-family policy); here: {self.fast_decode_reason}"
            )
        self._report: tuple[dict[str, float], list[tuple[str, dict]]] = ({}, [])
        # keyed requests' caches (GenerationRequest.key): the fast decoder's, without drafts
        self.keeps_kv = self.fast_decode and speculation is None
        self._kept: dict[str, _Kept] = {}

    def _decoder(self):
        return (
            FastDecoder(self.model) if self.fast_decode else _HFDecoder(self.model, self._cache_arg)
        )

    def detached_copy(self) -> TransformersEngine:
        """An engine over a copy of this one's model (same settings and weight version), for
        sampling on another thread while the original's model trains."""
        model = copy.deepcopy(self.model).eval().requires_grad_(False)
        engine = TransformersEngine(
            model,
            self.tokenizer,
            device=self.device,
            generation_batch=self.generation_batch,
            fast_decode=self.fast_decode_reason != "disabled",
            speculation=self.speculation.copy() if self.speculation else None,
            gen_timeout_s=self.gen_timeout_s,
        )
        engine.weight_version = self.weight_version
        return engine

    def load_weights(self, version: int, weights: WeightBuckets | None = None) -> None:
        """Copies each piece into the tensor of its name, bucket by bucket as they come (no
        second copy of the model); a name the model does not have is an error. Pieces not
        sent keep their values (a tied weight comes once, under either name)."""
        if weights is not None:
            own = self.model.state_dict()
            with torch.no_grad():
                for bucket in weights:
                    for name, tensor in bucket:
                        if name not in own:
                            raise ValueError(f"weights do not fit the engine's model: {name!r}")
                        own[name].copy_(tensor)
        self.weight_version = version

    def generate(self, requests: list[GenerationRequest], params: SamplingParams) -> list[Rollout]:
        too_long = [r for r in requests if len(r.prompt_ids) >= params.max_seq_len]
        if too_long:
            r = too_long[0]
            raise ValueError(
                f"prompt {r.prompt_id} has {len(r.prompt_ids)} tokens; rollout.max_seq_len is "
                f"{params.max_seq_len} (raise it or shorten the prompt)"
            )
        if params.n != 1 and any(r.key is not None for r in requests):
            raise ValueError("a keyed request is one sample to continue: sample it with n=1")
        flat = [r for r in requests for _ in range(params.n)]
        generator = torch.Generator(device=self.device).manual_seed(params.seed)
        rollouts: list[Rollout] = []
        spec = self.speculation
        speculate = spec is not None and spec.should_speculate()
        stats = SpecStats()
        kept, self._kept = self._kept, {}  # what this call leaves to continue replaces it
        for start in range(0, len(flat), self.generation_batch):
            chunk = flat[start : start + self.generation_batch]
            if speculate:
                rollouts += self._speculate_chunk(chunk, params, generator, stats)
            else:
                rollouts += self._generate_chunk(chunk, params, generator, kept)
        if spec is not None:
            self._add_report(spec.record(stats if speculate else None))
        if self.gen_timeout_s:
            cut = sum(r.finish_reason == "abort" for r in rollouts)
            self._add_report(({"rollout/gen_timeouts": float(cut)}, []))
        return rollouts

    def take_report(self) -> EngineReport:
        """Metrics and events of the generate calls since the last take (speculation)."""
        report, self._report = self._report, ({}, [])
        return report

    def _add_report(self, report) -> None:
        metrics, events = report
        self._report = (merge_metrics([self._report[0], metrics]), self._report[1] + events)

    @torch.no_grad()
    def _speculate_chunk(self, chunk, params: SamplingParams, generator, stats: SpecStats):
        started = time.perf_counter()
        ids, mask, positions, budget = self._prepare(chunk, params)
        was_training = self.model.training
        self.model.eval()
        spec = self.speculation
        target = FastDecoder(self.model)
        routers = routers_of(self.model)  # an MoE policy: record each token's experts
        session = routers.session(record=True) if routers else contextlib.nullcontext()
        fed: list | None = [] if routers else None
        with session:
            tokens, logprobs, chunk_stats = speculative_decode(
                target,
                spec.draft(self.model),
                ids,
                mask,
                positions,
                budget,
                spec.tokens,
                _distribution(params),
                generator,
                torch.tensor(sorted(self._stops(params)), device=self.device),
                self.tokenizer.pad_token_id,
                [list(r.prompt_ids) for r in chunk],
                min_accept=spec.min_accept,
                deadline=self._deadline(started),
                fed=fed,
            )
        self.model.train(was_training)
        stats.add(chunk_stats)
        seconds = time.perf_counter() - started
        rollouts = self._to_rollouts(
            chunk,
            tokens.tolist(),
            logprobs.tolist(),
            budget.tolist(),
            seconds,
            chunk_stats.cut.tolist() if chunk_stats.cut is not None else None,
            stops=self._stops(params),
        )
        if routers:
            _attach_drafted_experts(rollouts, session, target, ids.shape, fed)
        return rollouts

    def _stops(self, params: SamplingParams) -> set[int]:
        """The token ids that end a response of this call.

        Raises:
            ValueError: one of ``params.stop_ids`` is not a token id of the model.
        """
        vocab_size = self.model.get_input_embeddings().num_embeddings
        for token in params.stop_ids:
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
                raise ValueError(
                    f"stop_ids: {token} is not a token id of this model (0..{vocab_size - 1})"
                )
        return self.stop_ids | set(params.stop_ids)

    def _deadline(self, started: float) -> float:
        return started + self.gen_timeout_s if self.gen_timeout_s else float("inf")

    def _prepare(self, chunk, params: SamplingParams, held: list[int] | None = None):
        """Left-padded prompt ids and mask [B, P], positions, and each row's token budget;
        with ``held``, each row's first ``held[i]`` tokens are in a kept cache: the rows are
        the tokens after them, at positions from ``held[i]``."""
        held = held or [0] * len(chunk)
        rows = [r.prompt_ids[h:] for r, h in zip(chunk, held, strict=True)]
        ids, mask = _left_pad(rows, self.tokenizer.pad_token_id)
        ids, mask = ids.to(self.device), mask.to(self.device)  # [B, P]
        budget = torch.tensor(
            [min(params.max_new_tokens, params.max_seq_len - len(r.prompt_ids)) for r in chunk],
            device=self.device,
        )  # [B]
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # left padding: real tokens from 0
        positions = positions + torch.tensor(held, device=self.device)[:, None]
        return ids, mask, positions, budget

    def _reusable(self, chunk, kept: dict[str, _Kept]) -> list[_Kept | None]:
        """Each request's kept cache, where it has one that its ids extend."""
        found = []
        for r in chunk:
            entry = kept.get(r.key) if self.keeps_kv and r.key is not None else None
            fits = entry is not None and len(entry.ids) < len(r.prompt_ids)
            found.append(entry if fits and r.prompt_ids[: len(entry.ids)] == entry.ids else None)
        return found

    def _keep(self, chunk, rollouts: list[Rollout], decoder) -> None:
        """Keeps the cache of each keyed request cut at its length limit: its prompt and every
        response token but the last (which no step has fed yet)."""
        for row, (request, rollout) in enumerate(zip(chunk, rollouts, strict=True)):
            if request.key is None or rollout.finish_reason != "length":
                continue
            fed = len(rollout.response_ids) - 1
            keys, values = decoder.kept_cache(row, fed)
            ids = list(request.prompt_ids) + rollout.response_ids[:fed]
            self._kept[request.key] = _Kept(ids, keys, values)

    @torch.no_grad()
    def _generate_chunk(
        self,
        chunk: list[GenerationRequest],
        params: SamplingParams,
        generator: torch.Generator,
        kept: dict[str, _Kept],
    ) -> list[Rollout]:
        started = time.perf_counter()
        pad = self.tokenizer.pad_token_id
        stop = torch.tensor(sorted(self._stops(params)), device=self.device)
        reuse = self._reusable(chunk, kept)
        held = [len(entry.ids) if entry else 0 for entry in reuse]
        ids, mask, positions, budget = self._prepare(chunk, params, held)
        was_training = self.model.training
        if not self.fast_decode:  # the fast decoder runs no dropout: no mode switch to pay
            self.model.eval()
        decoder = self._decoder()
        routers = routers_of(self.model)  # an MoE policy: record each token's experts
        session = routers.session(record=True) if routers else contextlib.nullcontext()
        with session:
            if any(held):  # continued samples: their kept caches, then their new tokens
                caches = [(e.keys, e.values) if e else None for e in reuse]
                logits = decoder.resume(caches, ids, mask, positions, int(budget.max()))
                self._add_report(({"partial/kv_kept_tokens": float(sum(held))}, []))
            else:
                logits = decoder.prefill(ids, mask, positions, int(budget.max()))  # [B, V]
            tokens, logprobs = [], []
            done = torch.zeros(len(chunk), dtype=torch.bool, device=self.device)
            deadline, cut = self._deadline(started), None
            for t in range(int(budget.max())):
                token, logprob = self._sample(logits.float(), params, generator)  # [B], [B]
                token = torch.where(done, torch.full_like(token, pad), token)
                tokens.append(token)
                logprobs.append(logprob)
                done = done | torch.isin(token, stop) | (t + 1 >= budget)
                if bool(done.all()):
                    break
                if time.perf_counter() > deadline:  # rollout.gen_timeout_s: cut what runs
                    cut = [0 if finished else t + 1 for finished in done.tolist()]
                    break
                positions = positions[:, -1:] + 1
                logits = decoder.step(token, positions)
        if not self.fast_decode:
            self.model.train(was_training)
        seconds = time.perf_counter() - started
        rollouts = self._to_rollouts(
            chunk,
            torch.stack(tokens, 1).tolist(),
            torch.stack(logprobs, 1).tolist(),
            budget.tolist(),
            seconds,
            cut,
            stops=self._stops(params),
        )
        if routers and not any(held):  # a resumed prompt's experts are in earlier calls
            _attach_experts(rollouts, session, getattr(decoder, "prefill_rows", None), ids.shape)
        if self.keeps_kv:
            self._keep(chunk, rollouts, decoder)
        return rollouts

    @staticmethod
    def _sample(
        logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if params.greedy:
            token = logits.argmax(dim=-1)
            return token, logits.log_softmax(-1).gather(-1, token[:, None]).squeeze(-1)
        if params.temperature != 1.0:
            logits = logits / params.temperature
        logits = filter_logits(logits, params.top_k, params.top_p)  # what is sampled from
        probs = logits.softmax(-1)  # [B, V]: one fused kernel (no log-softmax, then exp)
        token = sample_categorical(probs, generator)
        return token, probs.gather(-1, token[:, None]).squeeze(-1).log()

    def _to_rollouts(
        self, chunk, token_rows, logprob_rows, budgets, seconds, cut=None, *, stops
    ) -> list[Rollout]:
        """Rollouts of the sampled rows; ``cut`` gives, for a row the generation timeout
        stopped, the tokens it had made (finish reason ``abort``), 0 for the others;
        ``stops``: the token ids that ended a row."""
        rollouts = []
        cut = cut or [0] * len(chunk)
        for request, row, logps, budget, was_cut in zip(
            chunk, token_rows, logprob_rows, budgets, cut, strict=True
        ):
            row = row[:budget]  # later columns are padding from rows still generating
            end = next((i + 1 for i, tok in enumerate(row) if tok in stops), None)
            if end is not None:
                reason = "stop"
            elif was_cut:
                end, reason = min(was_cut, len(row)), "abort"
            else:
                end, reason = len(row), "length"
            response = row[:end]
            rollouts.append(
                Rollout(
                    prompt_id=request.prompt_id,
                    group_index=request.group_index,
                    prompt_ids=list(request.prompt_ids),
                    response_ids=response,
                    behaviour_logprobs=logps[:end],
                    finish_reason=reason,
                    weight_version=self.weight_version,
                    text=self.tokenizer.decode(response, skip_special_tokens=True),
                    gen_seconds=seconds,
                )
            )
        return rollouts


@dataclass
class _Kept:
    """A keyed sample's cache: the token ids fed so far and their keys and values
    [L, Hkv, len(ids), D], as the weights of their time made them."""

    ids: list[int]
    keys: torch.Tensor
    values: torch.Tensor


def _attach_experts(rollouts: list[Rollout], session, prefill_rows, shape) -> None:
    """Give each rollout the experts its tokens were routed to (``Rollout.routed_experts``):
    the prompt's from the prefill, then one per decode step for every response token but the
    last. ``prefill_rows`` maps rows to the prefill rows that ran their (shared) prompt."""
    batch, width = shape
    calls = session.recorded_calls()  # the prefill's [run * P, L, k], then a [B, L, k] per step
    prefill = calls[0].view(-1, width, *calls[0].shape[1:]).cpu()
    if prefill_rows is not None:
        prefill = prefill[prefill_rows.cpu()]
    steps = torch.stack(calls[1:], 1).cpu() if len(calls) > 1 else prefill[:, :0]
    for row, rollout in enumerate(rollouts):
        prompt = prefill[row, width - len(rollout.prompt_ids) :]
        answered = steps[row, : max(len(rollout.response_ids) - 1, 0)]
        rollout.routed_experts = torch.cat([prompt, answered]).clone()  # its own storage


def _attach_drafted_experts(rollouts: list[Rollout], session, target, shape, fed) -> None:
    """``_attach_experts`` for a speculative call: the prompt's rows from the prefill, then
    from each pass of the policy the rows of the tokens it kept as inputs (``fed``: a verify
    pass feeds t, x_1 .. x_k and keeps t, x_1 .. x_a). A record that does not line up with
    the passes (a draft model that is the policy itself routes through the same routers)
    leaves the rollouts without experts, which routing replay R3 then refuses in one line."""
    calls = session.recorded_calls()
    if len(calls) != 1 + len(fed):
        return
    batch, width = shape
    prefill = calls[0].view(-1, width, *calls[0].shape[1:]).cpu()
    rows = getattr(target, "prefill_rows", None)
    if rows is not None:
        prefill = prefill[rows.cpu()]
    passes = [
        (call.view(batch, fed_width, *call.shape[1:]).cpu(), kept.tolist())
        for call, (fed_width, kept) in zip(calls[1:], fed, strict=True)
    ]
    for row, rollout in enumerate(rollouts):
        pieces = [prefill[row, width - len(rollout.prompt_ids) :]]
        pieces += [recorded[row, : kept[row]] for recorded, kept in passes if kept[row]]
        inputs = len(rollout.prompt_ids) + max(len(rollout.response_ids) - 1, 0)
        rollout.routed_experts = torch.cat(pieces)[:inputs].clone()  # its own storage


def _distribution(params: SamplingParams):
    """``logits [..., V] -> (probs, logprobs)``: the distribution a token is sampled from and
    the logprobs recorded for it, exactly as ``TransformersEngine._sample`` makes them."""

    def dist(logits: torch.Tensor):
        shape = logits.shape
        flat = logits.reshape(-1, shape[-1])
        if params.greedy:
            top = flat.argmax(-1)
            probs = torch.zeros_like(flat).scatter(-1, top[:, None], 1.0)
            return probs.view(shape), flat.log_softmax(-1).view(shape)
        if params.temperature != 1.0:
            flat = flat / params.temperature
        probs = filter_logits(flat, params.top_k, params.top_p).softmax(-1)
        return probs.view(shape), probs.log().view(shape)

    return dist
