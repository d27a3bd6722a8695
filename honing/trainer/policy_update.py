"""The policy update: PPO epochs over mini-batches, each accumulated over micro-batches.

Every micro-batch loss is normalised by its *mini-batch's* token and sequence counts, so the
gradient accumulated over any split into micro-batches equals the mini-batch's gradient
(tests/trainer/test_policy_update.py proves it), whether micro-batches hold a count of rows or
a token budget's worth (``max_tokens_per_micro``, tests/trainer/test_token_budget.py).
Metrics stay tensors until the end of the update: one host sync per step, not one per
micro-batch.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from honing.algorithms import aggregate_loss, get_policy_loss, kl_penalty, masked_mean
from honing.algorithms.mismatch import GAP_PEAKS, mismatch_metrics, truncated_importance_weights
from honing.algorithms.rollout_correction import (
    CorrectionSettings,
    correct,
    correction_metrics,
    is_peak,
    is_tally,
)
from honing.models.moe import routers_of
from honing.models.moe_stats import RouterStats, host_sums, moe_metrics, router_z_loss
from honing.trainer.batch import RouterTap, TrainBatch, response_logprobs
from honing.trainer.engine import TrainerEngine
from honing.trainer.memory import saved_bytes


@dataclass(frozen=True)
class UpdateSettings:
    """Plain numbers and names for one update (taken from the config by the caller)."""

    policy_loss: str = "ppo_clip"
    loss_agg: str = "token_mean"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    ppo_epochs: int = 1
    mini_batch_sequences: int = 0  # 0 = the whole batch in one optimizer step
    micro_batch_size: int = 64
    max_tokens_per_micro: int = 0  # padded tokens per micro-batch, rows balanced; 0 = by count
    grad_clip: float = 1.0
    temperature: float = 1.0
    clip_ratio_c: float = 0.0  # dual clip (ppo_clip only); 0 = off
    loss_scale_len: int = 0  # seq_mean_token_sum_norm's constant length; 0 = batch width
    autocast: str = "none"  # none | bfloat16 | float16: the forward passes' compute dtype
    packed: bool = True  # prompts once per group, no padding, where the model allows
    router_aux_coef: float = 0.0  # MoE: the family's load-balancing loss
    router_z_coef: float = 0.0  # MoE: the router z-loss
    # One optimizer step per batch: the update's forward, before the step, is the policy the
    # rollouts are weighed against. ``gap``: that forward gives the TIS weights (``tis_level``
    # none | token | sequence, capped at ``tis_cap``), the rollout correction's weights and
    # diagnostics (``correction``; one that needs the whole batch is the old pass's) and the
    # rollout_mismatch metrics, in place of a separate pass for the old logprobs
    # (``old_logprobs`` None).
    gap: bool = False
    tis_level: str = "none"
    tis_cap: float = 2.0
    correction: CorrectionSettings | None = None

    def optimizer_steps_per_batch(self, batch_size: int) -> int:
        per_epoch = -(-batch_size // (self.mini_batch_sequences or batch_size))
        return self.ppo_epochs * per_epoch


def autocast(dtype: str, device: torch.device):
    """``torch.autocast`` to ``dtype`` on ``device``'s kind, or nothing for ``none``."""
    if dtype == "none":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=getattr(torch, dtype))


def mini_batches(size: int, settings: UpdateSettings, generator: torch.Generator):
    """Yield index tensors: per epoch, a seeded shuffle cut into mini-batches."""
    mini = settings.mini_batch_sequences or size
    for _ in range(settings.ppo_epochs):
        order = torch.randperm(size, generator=generator) if mini < size else torch.arange(size)
        yield from torch.split(order, mini)


def policy_loss_options(settings: UpdateSettings) -> dict:
    """The loss's keyword options from the settings. Every loss takes the clip range and the
    aggregation; the dual clip goes in only when it is on (``ppo_clip``'s alone, which the
    config rules hold it to), so another loss given it fails instead of ignoring it."""
    options = {
        "clip_ratio_low": settings.clip_ratio_low,
        "clip_ratio_high": settings.clip_ratio_high,
        "loss_agg": settings.loss_agg,
    }
    if settings.clip_ratio_c:
        options["clip_ratio_c"] = settings.clip_ratio_c
    return options


def micro_loss(
    model,
    micro: TrainBatch,
    advantages,
    old_logprobs,
    ref_logprobs,
    counts: tuple,
    settings: UpdateSettings,
    tap: RouterTap | None = None,
    logprobs_of=response_logprobs,
) -> dict[str, torch.Tensor]:
    """The forward of one micro-batch: its loss, and its (detached) metric contributions.
    ``tap``: an MoE policy's routers (statistics, logits for the router losses);
    ``logprobs_of``: the logprob pass (the trainer engine's, as its layout runs it)."""
    # Normalisers of the whole mini-batch (and the whole batch's response width), so that
    # any micro-batch split gives the same gradient.
    num_tokens, num_seqs, scale_len = counts
    norm = {"num_tokens": num_tokens, "num_seqs": num_seqs, "loss_scale_len": scale_len}
    with autocast(settings.autocast, micro.input_ids.device):
        logprobs, entropy = logprobs_of(
            model,
            micro,
            temperature=settings.temperature,
            with_entropy=True,
            entropy_grad=settings.entropy_coef > 0,
            packed=settings.packed,
            tap=tap,
        )  # [b, R]
    # On-policy (one optimizer step per batch): the old policy is the current one, ratio = 1.
    old = logprobs.detach() if old_logprobs is None else old_logprobs
    mask = micro.response_mask
    share = mask.sum() / num_tokens  # this micro-batch's part of the mini-batch's tokens
    gap = {}
    if settings.gap and old_logprobs is None:  # the engine's logprobs against this forward's
        advantages, gap = _weighed(advantages, old, micro.behaviour_logprobs, mask, settings)
        gap = {k: v if k in GAP_PEAKS or is_tally(k) else v * share for k, v in gap.items()}
    loss, metrics = get_policy_loss(settings.policy_loss)(
        logprobs, old, advantages, mask, **policy_loss_options(settings), **norm
    )
    out = {k: v * share for k, v in metrics.items() if k != "actor/pg_loss"} | gap
    out["actor/pg_loss"] = metrics["actor/pg_loss"]
    out["actor/entropy"] = masked_mean(entropy.detach(), mask) * share
    if settings.kl_coef > 0:
        # KL to the frozen reference as a loss term (k3: http://joschu.net/blog/kl-approx.html).
        kl = kl_penalty(logprobs, ref_logprobs, settings.kl_estimator)  # [b, R]
        kl_loss = aggregate_loss(kl, mask, settings.loss_agg, **norm)
        loss = loss + settings.kl_coef * kl_loss
        out["actor/kl_loss"] = kl_loss.detach()
    if settings.entropy_coef > 0:  # entropy bonus: subtracting it rewards exploration
        loss = loss - settings.entropy_coef * aggregate_loss(
            entropy, mask, settings.loss_agg, **norm
        )
    if tap is not None and tap.logits:
        loss = loss + share * _router_losses(model, tap.logits, settings, out, share)
    return loss, out


def _weighed(advantages, old, behaviour, mask, settings: UpdateSettings):
    """``advantages`` with the TIS or rollout correction weights of ``old`` (this forward's
    logprobs, detached) against the engine's ``behaviour`` ones, and the gap's metrics (means
    over this micro-batch's tokens; ``GAP_PEAKS`` its maxima) and the correction's tally
    (sums and peaks, finished over the batch), as a separate old pass would give them."""
    metrics = mismatch_metrics(old, behaviour, mask)
    if settings.tis_level != "none":
        weights = truncated_importance_weights(
            old, behaviour, mask, level=settings.tis_level, cap=settings.tis_cap
        )
        advantages = advantages * weights
    if settings.correction is not None:
        corrected = correct(old, behaviour, mask, settings.correction)
        if corrected.weights is not None:
            advantages = advantages * corrected.weights
        metrics |= corrected.tally
    return advantages, metrics


def _router_losses(model, logits: list[torch.Tensor], settings: UpdateSettings, out, share):
    """The MoE router losses of one micro-batch (their metrics added to ``out``)."""
    routers = routers_of(model)
    total = 0.0
    if settings.router_aux_coef > 0:
        balance = routers.load_balancing_loss()
        aux = balance(tuple(logits), routers.num_experts, routers.top_k)
        total = total + settings.router_aux_coef * aux
        out["moe/aux_loss"] = aux.detach() * share
    if settings.router_z_coef > 0:
        z = router_z_loss(logits)
        total = total + settings.router_z_coef * z
        out["moe/z_loss"] = z.detach() * share
    return total


def row_tokens(batch: TrainBatch) -> torch.Tensor:
    """[B] (host) each row's tokens as a token budget counts them: the prompt width and its
    response, the width it is padded to in a micro-batch of rows no longer than itself."""
    return (batch.prompt_width + batch.response_real.sum(-1)).long().cpu()


def split_metrics(
    trainer: TrainerEngine,
    own: list[int],
    micros: list[int],
    whole: list[int],
    activations: int,
    device,
) -> dict[str, float]:
    """How the mini-batches were split, from each optimizer step's tokens this rank ran
    (``own``), its micro-batches (``micros``) and the mini-batch's tokens (``whole``):
    ``perf/token_imbalance``, the most tokens a rank ran over the ranks' mean (1.0 in one
    process), and ``perf/micro_batches``, the most micro-batches a rank ran; each per
    optimizer step, averaged over the update's steps. ``memory/activation_peak_mb``: the
    most bytes any rank's micro-batch forward kept for its backward (``activations``, this
    rank's), in the same maximum."""

    def numbers(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float64, device=device)

    most = {"tokens": numbers(own), "micros": numbers(micros), "saved": numbers([activations])}
    most = trainer.reduce(most, how="max")
    mean = numbers(whole) / trainer.data_parallel_size
    return {
        "perf/token_imbalance": float((most["tokens"] / mean).mean()),
        "perf/micro_batches": float(most["micros"].mean()),
        "memory/activation_peak_mb": float(most["saved"]) / 2**20,
    }


def _rows(index: torch.Tensor, width: int):
    """Select ``index`` rows of a [B, R] tensor, trimmed to the micro-batch's width."""
    return lambda t: None if t is None else t[index, :width]


def update_policy(
    trainer: TrainerEngine,
    batch: TrainBatch,
    advantages: torch.Tensor,
    settings: UpdateSettings,
    *,
    old_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> dict[str, float]:
    """Run the PPO epochs on ``batch`` with the policy's trainer engine ``trainer``; returns
    the step's actor metrics as floats.

    An optimizer step whose gradient norm is not finite is skipped (counted in
    ``actor/skipped_updates``) rather than let NaN into the weights.

    ``advantages``, ``old_logprobs`` and ``ref_logprobs`` are [B, R] aligned with
    ``batch.responses``. ``old_logprobs`` may be None only for one optimizer step per batch.

    Across processes (``trainer``'s layout: torchrun ranks, each called with the same batch and
    the same weights and optimizer state) each process runs its rows of each mini-batch;
    losses are normalised by the whole mini-batch's counts as always, so the reduced
    gradients give the single-process step on every process. Metrics are reduced likewise.
    """
    generator = generator or torch.Generator().manual_seed(0)
    model = trainer.module
    if not model.training:  # a module walk: only when generation left it in eval mode
        model.train()
    totals: dict[str, torch.Tensor] = {}
    peaks: dict[str, torch.Tensor] = {}  # the engine/trainer gap's maxima (``settings.gap``)
    grad_norms = []
    optimizer_steps = skipped = 0
    routers = routers_of(model)
    stats = RouterStats() if routers is not None else None
    router_losses = settings.router_aux_coef > 0 or settings.router_z_coef > 0
    tokens = row_tokens(batch)  # [B]
    own, micros, whole = [], [], []
    weights, activations = list(model.parameters()), 0  # weights are not activations
    for index in mini_batches(len(batch), settings, generator):
        num_tokens = batch.response_mask[index].sum().clamp(min=1)
        scale_len = settings.loss_scale_len or batch.responses.shape[1]
        counts = (num_tokens, float(len(index)), float(scale_len))
        trainer.zero_grad()
        split = trainer.rows(
            index, settings.micro_batch_size, tokens[index], settings.max_tokens_per_micro
        )
        own.append(sum(int(tokens[micro_index[:real]].sum()) for micro_index, real in split))
        micros.append(len(split))
        whole.append(int(tokens[index].sum()))
        for micro_index, real in split:
            micro = batch.select(micro_index).masked_after(real)
            rows = _rows(micro_index, micro.responses.shape[1])
            tap = None
            if routers is not None:  # statistics before the step's first optimizer step
                tap = RouterTap(stats=stats if optimizer_steps == 0 else None)
                tap.keep_logits = router_losses
            with saved_bytes(weights) as saved:  # what this forward keeps for its backward
                loss, contrib = micro_loss(
                    model,
                    micro,
                    rows(advantages),
                    rows(old_logprobs),
                    rows(ref_logprobs),
                    counts,
                    settings,
                    tap,
                    trainer.response_logprobs,
                )
            loss.backward()
            activations = max(activations, saved.bytes)
            for name, value in contrib.items():
                if name in GAP_PEAKS or is_peak(name):
                    peaks[name] = torch.maximum(peaks[name], value) if name in peaks else value
                else:
                    totals[name] = totals.get(name, 0) + value
        norm, stepped = trainer.step(settings.grad_clip)
        optimizer_steps += 1
        if stepped:
            grad_norms.append(norm)
        else:
            skipped += 1
    totals = trainer.reduce(totals)
    tally = {name: totals.pop(name) for name in list(totals) if is_tally(name)}
    metrics = {name: float(value) / optimizer_steps for name, value in totals.items()}
    if settings.gap and old_logprobs is None:  # (every rank alike: each has rows)
        peaks = trainer.reduce(peaks, "max")
        tally |= {name: value for name, value in peaks.items() if is_tally(name)}
        metrics |= {name: float(value) for name, value in peaks.items() if name in GAP_PEAKS}
        if settings.correction is not None:  # sums and counts over every rank's tokens
            metrics |= correction_metrics(tally, settings.correction)
    metrics["actor/grad_norm"] = float(torch.stack(grad_norms).mean()) if grad_norms else math.nan
    metrics["actor/skipped_updates"] = skipped
    metrics |= split_metrics(trainer, own, micros, whole, activations, batch.input_ids.device)
    if stats is not None:
        sums = host_sums(trainer.reduce(stats.sums()))
        metrics |= moe_metrics(sums, routers.layers, routers.num_experts, routers.null_experts)
    return metrics
