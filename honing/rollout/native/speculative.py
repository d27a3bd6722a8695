"""Speculative decoding for honing's engine (``rollout.speculative``): a draft proposes ``k``
tokens per row, the policy scores all of them in one forward pass, and the standard rejection
rule (Leviathan et al. 2023, https://arxiv.org/abs/2211.17192; Chen et al. 2023) keeps the
output distribution exactly the policy's sampling distribution (after temperature, top-k and
top-p):

- draft token x_j, drawn from the draft's distribution q_j, is accepted with probability
  min(1, p_j(x_j) / q_j(x_j)), p_j being the policy's distribution at that position;
- at the first rejection the row's next token is drawn from norm(max(0, p_j - q_j)); when all
  k are accepted, one more is drawn from the policy's next distribution (the bonus token).

A draft that proposes without a distribution (prompt lookup) is a point mass: x_j is accepted
with probability p_j(x_j), and a rejection draws from p_j with x_j removed. Every emitted
token's behaviour logprob is its logprob under the policy's sampling distribution, as without
speculation, so the trainer's importance ratios do not change meaning.

The batch stays in lockstep: every round appends k + 1 slots to the policy's KV cache for every
row, and the slots of rejected tokens become holes that later queries do not see
(``FastDecoder.extend`` / ``drop``). A round therefore costs one k-position verify forward plus
the draft's proposals, and emits between 1 and k + 1 tokens per row.

Drafts:
- ``NgramDraft`` (``rollout.speculative=ngram``): prompt lookup, the tokens that followed the
  last earlier occurrence of the row's trailing n-gram (n = 3, 2, 1) in its prompt and output.
- ``ModelDraft`` (``rollout.speculative=draft``, ``rollout.spec_draft=PATH``): a small causal LM
  with the policy's tokenizer, run with its own ``FastDecoder``.
- ``mtp.MtpDraft`` (``rollout.speculative=mtp``): multi-token-prediction heads on the policy's
  own hidden states, trained online from the rollouts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from honing.rollout.native.fast_decode import FastDecoder, unwrap
from honing.rollout.native.mtp import MtpDraft
from honing.rollout.native.sampling import sample_categorical


@dataclass
class SpecStats:
    """One call's speculation: verify rounds, draft tokens proposed and accepted (rows that
    were still generating), and whether it stopped speculating part way (``aborted``)."""

    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    row_rounds: int = 0
    aborted: bool = False
    cut: torch.Tensor | None = None  # per row: tokens made when the timeout cut it (0: not)

    @property
    def accept_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def accepted_len(self) -> float:
        """Draft tokens accepted per row and verify round."""
        return self.accepted / self.row_rounds if self.row_rounds else 0.0

    def add(self, other: SpecStats) -> None:
        self.rounds += other.rounds
        self.proposed += other.proposed
        self.accepted += other.accepted
        self.row_rounds += other.row_rounds
        self.aborted |= other.aborted


class NgramDraft:
    """Prompt lookup: proposes the continuation of the last earlier match of the row's trailing
    n-gram (longest n first); without a match, the last token repeated (soon rejected)."""

    point_mass = True

    def __init__(self, max_ngram: int = 3):
        self.max_ngram = max_ngram

    def start(self, decoder_inputs, prompt_rows: list[list[int]], first: list[int]) -> None:
        self.rows = [list(row) + [token] for row, token in zip(prompt_rows, first, strict=True)]

    def propose(self, t, pos_t, k: int, dist, generator):
        proposals = [self._lookup(row, k) for row in self.rows]
        return torch.tensor(proposals, dtype=torch.long, device=t.device), None

    def _lookup(self, row: list[int], k: int) -> list[int]:
        for n in range(min(self.max_ngram, len(row) - 1), 0, -1):
            tail = row[-n:]
            for start in range(len(row) - n - 1, -1, -1):  # the latest earlier occurrence
                if row[start : start + n] == tail:
                    follow = row[start + n : start + n + k]
                    return follow + [follow[-1]] * (k - len(follow))
        return [row[-1]] * k

    def settle(self, accepted: torch.Tensor, emitted: torch.Tensor, count: torch.Tensor):
        for row, tokens, n in zip(self.rows, emitted.tolist(), count.tolist(), strict=True):
            row += tokens[:n]


def _fit(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """A draft's logits over the policy's vocabulary: entries the policy does not have are
    dropped, entries the draft does not have get -inf (the draft never proposes them).
    Drafts of one family often differ only in padding rows (Qwen2.5: 151,936 vs 152,064)."""
    size = logits.shape[-1]
    if size > vocab:
        return logits[..., :vocab]
    if size < vocab:
        return torch.nn.functional.pad(logits, (0, vocab - size), value=float("-inf"))
    return logits


class ModelDraft:
    """A small causal LM proposing k tokens by sampling from its own (filtered, tempered)
    distribution; its KV cache follows the policy's with holes for rejected proposals."""

    point_mass = False

    def __init__(self, model, vocab: int):
        self.model, self.vocab = model, vocab  # vocab: the policy's output size

    def start(self, decoder_inputs, prompt_rows, first) -> None:
        ids, mask, positions, capacity = decoder_inputs
        self.decoder = FastDecoder(self.model)
        self.decoder.prefill(ids, mask, positions, capacity)
        self.previous = torch.zeros_like(ids[:, 0])  # x_k of the last round, when accepted
        self.previous_kept = torch.zeros_like(ids[:, 0], dtype=torch.bool)

    def propose(self, t, pos_t, k: int, dist, generator):
        self.round_start = self.decoder.length
        block = torch.stack([self.previous, t], 1)
        positions = torch.stack([(pos_t - 1).clamp(min=0), pos_t], 1)
        keep = torch.stack([self.previous_kept, torch.ones_like(self.previous_kept)], 1)
        logits = self.decoder.extend(block, positions, keep)[:, -1]
        tokens, dists = [], []
        for j in range(k):
            probs, _ = dist(_fit(logits.float(), self.vocab))
            token = sample_categorical(probs, generator)
            tokens.append(token)
            dists.append(probs / probs.sum(-1, keepdim=True))
            if j < k - 1:
                logits = self.decoder.step(token, (pos_t + 1 + j)[:, None])
        self.last = tokens[-1]
        return torch.stack(tokens, 1), torch.stack(dists, 1)

    def settle(self, accepted: torch.Tensor, emitted: torch.Tensor, count: torch.Tensor):
        k = emitted.shape[1] - 1
        # this round's slots: [x_k of the last round or a hole, t, x_1 .. x_{k-1}]
        slot = torch.arange(k + 1, device=accepted.device)[None]
        self.decoder.drop(self.round_start, slot >= accepted[:, None] + 2)
        self.previous = self.last
        self.previous_kept = accepted == k  # x_k is accepted: the draft has not seen it yet


def speculative_decode(
    target: FastDecoder,
    draft,
    ids: torch.Tensor,
    mask: torch.Tensor,
    positions: torch.Tensor,
    budget: torch.Tensor,
    k: int,
    dist,
    generator: torch.Generator,
    stop: torch.Tensor,
    pad: int,
    prompt_rows: list[list[int]],
    judge_after: int = 4,
    min_accept: float = 0.0,
    deadline: float = float("inf"),
    fed: list | None = None,
) -> tuple[torch.Tensor, torch.Tensor, SpecStats]:
    """Sample up to ``budget`` [B] tokens per row (see the module).

    ``dist(logits [..., V]) -> (probs, logprobs)``: the sampling distribution (probabilities
    for the draws and the acceptance test; log-probabilities recorded for the trainer). After
    ``judge_after`` rounds with an acceptance rate below ``min_accept`` the call stops
    speculating and decodes one token per step (``stats.aborted``). Past ``deadline``
    (``time.perf_counter``) the rows still generating are cut (``stats.cut``).

    Returns tokens [B, N] and their logprobs [B, N] (``pad`` after a row's end), and the stats.
    ``fed``, when given, gets one entry per pass of ``target`` after the prefill: (tokens each
    row fed, [B] how many of them each row kept as inputs of its response), so that what the
    pass recorded of each token (routed experts) can be kept for the tokens kept.
    """
    rows, device = ids.shape[0], ids.device
    most = int(budget.max())
    capacity = most * (k + 1) + 1
    if hasattr(draft, "bind"):  # a draft that reads the policy's hidden states (MTP heads)
        draft.bind(target)
    logits = target.prefill(ids, mask, positions, capacity)
    probs, logp = dist(logits.float())
    t = sample_categorical(probs, generator)
    width = most + k + 1
    tokens = torch.full((rows, width), pad, dtype=torch.long, device=device)
    logprobs = torch.zeros(rows, width, device=device)
    tokens[:, 0] = t
    logprobs[:, 0] = logp.gather(-1, t[:, None]).squeeze(-1)
    count = torch.ones(rows, dtype=torch.long, device=device)
    done = torch.isin(t, stop) | (count >= budget)
    pos_t = positions[:, -1] + 1
    draft.start((ids, mask, positions, capacity), prompt_rows, t.tolist())
    stats = SpecStats()
    offsets = torch.arange(k + 1, device=device)
    while not bool(done.all()):
        if time.perf_counter() > deadline:
            stats.cut = torch.where(done, torch.zeros_like(count), count)  # 0: not cut
            break
        if stats.aborted:  # plain decoding: one token per row and step
            probs, logp = dist(target.step(t, pos_t[:, None]).float())
            t = sample_categorical(probs, generator)
            active = ~done
            at = count.clamp(max=width - 1)[:, None]
            tokens.scatter_(1, at, torch.where(active, t, tokens.gather(1, at)[:, 0])[:, None])
            lp = logp.gather(-1, t[:, None])
            logprobs.scatter_(1, at, torch.where(active[:, None], lp, logprobs.gather(1, at)))
            count = torch.where(active, count + 1, count)
            done = done | (active & (torch.isin(t, stop) | (count >= budget)))
            pos_t = pos_t + 1
            if fed is not None:
                fed.append((1, active.long()))
            continue
        x, q = draft.propose(t, pos_t, k, dist, generator)  # [B, k], [B, k, V] or None
        start = target.length
        block = torch.cat([t[:, None], x], 1)  # [B, k + 1]
        logits = target.extend(
            block, pos_t[:, None] + offsets, torch.ones_like(block, dtype=torch.bool)
        )
        p, lp = dist(logits.float())  # [B, k + 1, V]: p[:, j] is the distribution of x_{j+1}
        px = p[:, :k].gather(-1, x[..., None]).squeeze(-1)  # [B, k]
        if q is None:
            ratio = px / p[:, :k].sum(-1)
        else:
            qx = q.gather(-1, x[..., None]).squeeze(-1)
            ratio = (px / p[:, :k].sum(-1)) / qx
        u = torch.rand(rows, k, dtype=torch.float64, device=device, generator=generator)
        accepted = (u < ratio.double()).long().cumprod(1).sum(1)  # [B]
        target_next = p.gather(1, accepted[:, None, None].expand(-1, 1, p.shape[-1]))[:, 0]
        full = accepted == k
        at = accepted.clamp(max=k - 1)
        if q is None:
            residual = target_next.scatter(1, x.gather(1, at[:, None]), 0.0)
        else:
            q_at = q.gather(1, at[:, None, None].expand(-1, 1, q.shape[-1]))[:, 0]
            normal = target_next / target_next.sum(-1, keepdim=True)
            residual = (normal - q_at).clamp(min=0)
        residual = torch.where(full[:, None], target_next, residual)
        empty = residual.sum(-1) <= 0  # p == q to rounding: p itself
        residual = torch.where(empty[:, None], target_next, residual)
        y = sample_categorical(residual, generator)
        emitted = torch.cat([x, torch.zeros_like(y)[:, None]], 1).scatter(
            1, accepted[:, None], y[:, None]
        )
        emitted_lp = lp.gather(-1, emitted[..., None]).squeeze(-1)  # [B, k + 1]
        kept = accepted + 1
        active = ~done
        at = (count[:, None] + offsets).clamp(max=width - 1)
        write = active[:, None] & (offsets[None] < kept[:, None])
        tokens.scatter_(1, at, torch.where(write, emitted, tokens.gather(1, at)))
        logprobs.scatter_(1, at, torch.where(write, emitted_lp, logprobs.gather(1, at)))
        stopped = (torch.isin(emitted, stop) & (offsets[None] < kept[:, None])).any(1)
        count = torch.where(active, count + kept, count)
        done = done | (active & (stopped | (count >= budget)))
        if fed is not None:  # t, x_1 .. x_a: the inputs of the tokens this round emitted
            fed.append((k + 1, torch.where(active, kept, torch.zeros_like(kept))))
        target.drop(start, offsets[None] > accepted[:, None])  # keep t and x_1 .. x_a
        draft.settle(accepted, emitted, kept)
        live = int(active.sum())
        stats.rounds += 1
        stats.row_rounds += live
        stats.proposed += k * live
        stats.accepted += int(accepted[active].sum())
        t, pos_t = y, pos_t + kept
        if stats.rounds >= judge_after and stats.accept_rate < min_accept:
            stats.aborted = True
    return tokens[:, :most], logprobs[:, :most], stats


class Speculation:
    """The engine's speculation settings and its automatic switch.

    ``should_speculate`` before each generate call, ``record`` after it. A call whose
    acceptance rate is below ``min_accept`` (or that stopped speculating part way) turns
    speculation off (event ``speculation_off``); while off, every ``probe_every``-th call
    speculates again as a probe, and one that reaches ``min_accept`` turns it back on
    (``speculation_on``). Metrics of a call that speculated: ``rollout/spec_accept_rate``
    (accepted / proposed draft tokens), ``rollout/spec_accepted_len`` (draft tokens accepted
    per row and verify round); ``rollout/spec_enabled`` is 1 when the call speculated.
    """

    def __init__(
        self,
        kind: str,
        tokens: int,
        min_accept: float,
        probe_every: int,
        draft_model=None,
    ):
        if kind not in ("ngram", "draft", "mtp"):
            raise ValueError(f"rollout.speculative: {kind!r} is not ngram, draft or mtp")
        if kind in ("draft", "mtp") and draft_model is None:
            raise ValueError(f"rollout.speculative={kind} needs a draft model or MTP heads")
        self.kind, self.tokens = kind, tokens
        self.min_accept, self.probe_every = min_accept, probe_every
        self.draft_model = draft_model
        self.enabled = True
        self.calls_off = 0

    def copy(self) -> Speculation:
        """The same settings and state, sharing the (read-only) draft model."""
        other = Speculation(
            self.kind, self.tokens, self.min_accept, self.probe_every, self.draft_model
        )
        other.enabled, other.calls_off = self.enabled, self.calls_off
        return other

    def draft(self, policy=None):
        """A fresh draft for one generation; ``mtp`` reads ``policy``'s output head."""
        if self.kind == "ngram":
            return NgramDraft()
        if self.kind == "mtp":
            return MtpDraft(self.draft_model, policy)

        vocab = unwrap(policy).get_output_embeddings().weight.shape[0]
        return ModelDraft(self.draft_model, vocab)

    def should_speculate(self) -> bool:
        if self.enabled:
            return True
        self.calls_off += 1
        return self.calls_off >= self.probe_every

    def record(self, stats: SpecStats | None) -> tuple[dict[str, float], list[tuple[str, dict]]]:
        if stats is None:
            return {"rollout/spec_enabled": 0.0}, []
        if not stats.proposed:  # nothing was drafted (every row ended at once): no verdict
            return {"rollout/spec_enabled": 1.0}, []
        rate = stats.accept_rate
        metrics = {
            "rollout/spec_accept_rate": rate,
            "rollout/spec_accepted_len": stats.accepted_len,
            "rollout/spec_enabled": 1.0,
            # the raw counts, as vLLM's spec-decode counters name them (drafts = sequence-rounds)
            "rollout/spec_drafts": float(stats.row_rounds),
            "rollout/spec_draft_tokens": float(stats.proposed),
            "rollout/spec_accepted_tokens": float(stats.accepted),
        }
        good = rate >= self.min_accept and not stats.aborted
        fields = {"accept_rate": round(rate, 4), "min_accept": self.min_accept}
        events = []
        if self.enabled and not good:
            self.enabled, self.calls_off = False, 0
            events.append(("speculation_off", fields | {"probe_every": self.probe_every}))
        elif not self.enabled:
            self.calls_off = 0
            if good:
                self.enabled = True
                events.append(("speculation_on", fields))
        return metrics, events


COUNTS = ("rollout/spec_drafts", "rollout/spec_draft_tokens", "rollout/spec_accepted_tokens")


def merge_metrics(reports: list[dict[str, float]]) -> dict[str, float]:
    """Several generate calls' engine metrics as one: counts (speculation's, timeouts, kept
    cache tokens) summed,
    the acceptance recomputed from them, ``rollout/spec_enabled`` 1 if any call speculated;
    the turn loops' ``tool/*`` metrics weighted by the samples behind them."""
    from honing.rollout.tools.turns import merge_tool_metrics

    merged: dict[str, float] = merge_tool_metrics(reports)
    for metrics in reports:
        for key in ("rollout/gen_timeouts", "partial/kv_kept_tokens", *COUNTS):
            if key in metrics:
                merged[key] = merged.get(key, 0.0) + metrics[key]
        if "rollout/spec_enabled" in metrics:
            merged["rollout/spec_enabled"] = max(
                merged.get("rollout/spec_enabled", 0.0), metrics["rollout/spec_enabled"]
            )
    if merged.get("rollout/spec_draft_tokens"):
        accepted = merged["rollout/spec_accepted_tokens"]
        merged["rollout/spec_accept_rate"] = accepted / merged["rollout/spec_draft_tokens"]
        merged["rollout/spec_accepted_len"] = accepted / max(merged["rollout/spec_drafts"], 1.0)
    return merged
