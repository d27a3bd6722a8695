"""Scored rollouts -> experience: padded tensors, reference / old logprobs, advantages.

The stage between scoring and the update in docs/design.md's data flow. In order:
1. collate the rollouts ([N, P + R] inputs, [N, R] response tensors);
2. logprobs without gradient: the frozen reference (when ``kl_coef > 0``), the teacher (on-policy
   distillation: its logprobs of the sampled tokens minus the student's are the per-token
   rewards of ``advantage=distill``) and the pre-update
   policy (when several optimizer steps follow, or for a KL reward penalty; for one optimizer
   step the update's own forward gives them, and TIS and the engine/trainer gap with them);
3. with ``kl_in_reward``, each token's reward is ``-beta * KL`` and the score sits on the last
   token; the group estimators see the summed token rewards as the score;
4. advantages by the configured estimator, with its settings passed explicitly;
5. DAPO's masking of truncated answers, and TIS or rollout correction against the
   engine/trainer gap: weights on the advantages, rejected tokens out of the loss mask.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from honing.algorithms import get_advantage, kl_penalty, masked_mean
from honing.algorithms.mismatch import mismatch_metrics, truncated_importance_weights
from honing.algorithms.rollout_correction import correct, correction_metrics
from honing.config import Config
from honing.models.loading import is_lora
from honing.pipeline.components import Components, tis_level
from honing.pipeline.peers import Alone, Op, Peers
from honing.rollout.base import Holding
from honing.trainer.batch import RouterTap, TrainBatch, collate
from honing.trainer.engine import TrainerEngine
from honing.trainer.policy_update import autocast
from honing.types import Rollout


@dataclass
class Experience:
    batch: TrainBatch
    advantages: torch.Tensor  # [N, R]
    old_logprobs: torch.Tensor | None  # [N, R]; None = on-policy shortcut in the update
    ref_logprobs: torch.Tensor | None  # [N, R]
    metrics: dict[str, float]
    old_values: torch.Tensor | None = None  # [N, R] the critic's values before its update
    returns: torch.Tensor | None = None  # [N, R] the critic's targets
    # the update's forward weighs the rollouts (TIS, rollout_mismatch/*): no old pass ran
    gap_in_update: bool = False


def weighs_rollouts(config: Config, parts: Components) -> bool:
    """Whether each batch's rollouts are weighed against the policy before the update: for
    TIS or rollout correction, and whenever the engine samples with weights of its own
    (another process, vLLM, a copy): the gap between its logprobs and the trainer's is then
    logged every step (``rollout_mismatch/*``), so a broken weight sync shows in every run's
    metrics."""
    return (
        parts.engine.holds is not Holding.SHARED
        or tis_level(config) != "none"
        or parts.update_settings.correction is not None
    )


def needs_old_logprobs(
    config: Config, parts: Components, batch_size: int, policy_acts: bool = True
) -> bool:
    """Whether the trainer runs a pass for the policy's logprobs before the update: for a KL
    reward penalty, for several optimizer steps per batch (each after the first needs the
    policy as it sampled), for a rollout correction that needs the whole batch before the
    loss (rejection, batch-normalised weights), and to weigh the rollouts
    (``weighs_rollouts``) when the policy does not update this step (a critic's warm-up).
    Otherwise one optimizer step's own forward, before the step, gives those logprobs
    (``UpdateSettings.gap``)."""
    algo, correction = config.algorithm, parts.update_settings.correction
    return (
        (algo.kl_in_reward and algo.kl_coef > 0)
        or parts.update_settings.optimizer_steps_per_batch(batch_size) > 1
        or (correction is not None and correction.needs_whole_batch)
        or (weighs_rollouts(config, parts) and not policy_acts)
    )


def token_level_rewards(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each sequence's score on its last response token: [N] -> [N, R] (the last the model
    sampled: a multi-turn mask has holes where tool responses are)."""
    positions = torch.arange(mask.shape[-1], device=mask.device)
    last = torch.where(mask.bool(), positions, 0).amax(-1)  # [N]
    rewards = torch.zeros_like(mask)
    rewards[torch.arange(len(scores)), last] = scores
    return rewards * mask


@dataclass(frozen=True)
class Passes:
    """Which passes without gradient a step's batch needs."""

    reference: bool  # the reference's logprobs (KL)
    values: bool  # the critic's values (gae)
    old: bool  # the policy's own logprobs before the update
    record_routing: bool = False  # routing replay R2: keep the old pass's experts
    teacher: bool = False  # the teacher's logprobs (on-policy distillation)


def forward_passes(parts: Components, batch: TrainBatch, wanted: Passes) -> dict:
    """The passes ``wanted`` of ``batch`` ([N, R] each, or None) and their timings; under a
    sharded layout every rank runs this with the same batch, each computing its rows."""
    update, policy = parts.update_settings, parts.trainers.policy
    width = batch.responses.shape[1]

    def logprobs_of(model, tap=None):
        return lambda rows: policy.response_logprobs(
            model, rows, temperature=update.temperature, packed=update.packed, tap=tap
        )[0]

    out: dict = {"ref": None, "teacher": None, "values": None, "old": None, "replay": None}
    out["metrics"] = {}
    with torch.no_grad(), autocast(update.autocast, parts.device):
        if wanted.reference:
            started = time.perf_counter()
            if parts.reference is not None:
                out["ref"] = policy.forward_rows(logprobs_of(parts.reference), batch, width)
            else:  # LoRA: the reference is the base model, the policy with adapters off
                with policy.module.disable_adapter():
                    out["ref"] = policy.forward_rows(logprobs_of(policy.module), batch, width)
            out["metrics"]["timing_s/ref"] = time.perf_counter() - started
        if wanted.teacher:
            started = time.perf_counter()
            out["teacher"] = policy.forward_rows(logprobs_of(parts.teacher), batch, width)
            out["metrics"]["timing_s/teacher"] = time.perf_counter() - started
        critic = parts.trainers.critic
        if wanted.values:
            out["values"] = critic.forward_rows(critic.values, batch, width)
        if wanted.old:
            started = time.perf_counter()
            tap = RouterTap(record=True) if wanted.record_routing else None
            out["old"] = policy.forward_rows(logprobs_of(policy.module, tap), batch, width)
            if tap is not None:  # R2: the update passes replay what this pass chose
                out["replay"] = _whole_plan(policy, tap.recorded, batch)
            out["metrics"]["timing_s/old"] = time.perf_counter() - started
    return out


def _whole_plan(policy: TrainerEngine, recorded: torch.Tensor, batch: TrainBatch) -> torch.Tensor:
    """The batch's [B, P + R, L, k] plan from a pass's record: the pass's own where it ran
    the whole batch; where every rank takes part in the passes (sharded, or
    sequence-parallel) each rank recorded its rows (trimmed to their longest response),
    gathered here as a rowwise result."""
    if not policy.passes_together:
        return recorded
    columns, layers, top_k = batch.input_ids.shape[1], *recorded.shape[2:]
    shape = (len(recorded), columns, layers, top_k)
    mine = torch.full(shape, -1, dtype=torch.int32, device=recorded.device)
    mine[:, : recorded.shape[1]] = recorded.to(torch.int32)
    whole = policy.forward_rows(lambda rows: mine.flatten(1), batch, columns * layers * top_k)
    return whole.view(len(batch), columns, layers, top_k).to(recorded.dtype)


def make_experience(
    config: Config,
    parts: Components,
    rollouts: list[Rollout],
    rewards: list[float],
    baselines: dict[int, float] | None = None,
    peers: Peers | None = None,
    policy_acts: bool = True,
) -> Experience:
    """``peers``: the run's other processes, which take part in the passes without gradient
    when the modules are sharded over them; ``policy_acts``: the policy updates on this
    batch (not during a critic's warm-up)."""
    algo = config.algorithm
    batch = collate(rollouts, parts.tokenizer.pad_token_id, parts.device)
    mask = batch.response_mask
    if algo.routing_replay == "R3":  # every pass routes as the rollout did
        if batch.rollout_routing is None:
            raise ValueError(
                "algorithm.routing_replay=R3: the rollouts carry no routed experts "
                "(the rollout engine did not report them)"
            )
        batch.replay = batch.rollout_routing
    wanted = Passes(
        reference=parts.reference is not None or (algo.kl_coef > 0 and is_lora(parts.policy)),
        teacher=isinstance(parts.teacher, torch.nn.Module),
        values=parts.trainers.critic is not None,
        old=needs_old_logprobs(config, parts, len(batch), policy_acts),
        record_routing=algo.routing_replay == "R2",
    )
    with (peers or Alone()).together(Op.FORWARD, (batch, wanted)):
        passes = forward_passes(parts, batch, wanted)
    if passes["replay"] is not None:
        batch.replay = passes["replay"]
    metrics: dict[str, float] = dict(passes["metrics"])
    ref_logprobs, old_values, old_logprobs = passes["ref"], passes["values"], passes["old"]
    scores = torch.tensor(rewards, dtype=torch.float32, device=parts.device)  # [N]
    token_rewards = token_level_rewards(scores, mask)  # [N, R]
    if algo.kl_in_reward and ref_logprobs is not None:
        kl = kl_penalty(old_logprobs, ref_logprobs, algo.kl_estimator) * mask  # [N, R]
        token_rewards = token_rewards - parts.kl_controller.value * kl
        scores = token_rewards.sum(-1)
        current_kl = float(masked_mean(kl, mask, dim=-1).mean())
        metrics |= {"critic/kl": current_kl, "actor/kl_coef": parts.kl_controller.value}
        parts.kl_controller.update(current_kl, len(batch))
    baseline_scores = None
    if baselines is not None and config.algorithm.advantage == "remax":
        # A failed greedy score (NaN) falls back to no baseline for that prompt.
        baseline_scores = torch.tensor(
            [baselines.get(r.group_index, 0.0) for r in rollouts], device=parts.device
        ).nan_to_num(0.0)
    distill_rewards, teacher = None, passes["teacher"]
    if parts.teacher is not None and teacher is None:  # served: asked for the samples
        started = time.perf_counter()
        teacher = served_logprobs(parts.teacher, rollouts, batch)
        metrics["timing_s/teacher"] = time.perf_counter() - started
    if teacher is not None:
        distill_rewards, metrics["distill/reverse_kl"] = teacher_rewards(
            teacher, old_logprobs, batch, algo.distill_coef
        )
    advantages, returns = _advantages(
        config,
        parts,
        scores,
        token_rewards,
        batch,
        rollouts,
        old_values,
        baseline_scores,
        distill_rewards,
    )
    adv_mean = advantages.sum() / mask.sum()
    metrics["critic/advantages/mean"] = float(adv_mean)
    metrics["critic/advantages/var"] = float(
        ((advantages - adv_mean) ** 2 * mask).sum() / mask.sum()
    )
    truncated = 0
    if algo.mask_truncated:
        # DAPO's overlong filtering: a cut-off answer counts in its group's baseline but
        # gives no gradient (its reward says little about the tokens it did produce).
        cut = torch.tensor([r.finish_reason == "length" for r in rollouts], device=parts.device)
        batch.response_mask[cut] = 0.0
        truncated = int(cut.sum())
    metrics |= {"samples/trained": len(batch) - truncated, "samples/filtered_truncated": truncated}
    if old_logprobs is not None:
        behaviour = batch.behaviour_logprobs
        metrics |= {k: float(v) for k, v in mismatch_metrics(old_logprobs, behaviour, mask).items()}
        if tis_level(config) != "none":
            advantages = advantages * truncated_importance_weights(
                old_logprobs,
                behaviour,
                batch.response_mask,
                level=tis_level(config),
                cap=algo.tis_cap,
            )
        if (correction := parts.update_settings.correction) is not None:
            advantages, correction_tally = _corrected(
                advantages, old_logprobs, behaviour, batch, correction
            )
            metrics |= correction_metrics(correction_tally, correction)
    gap_in_update = old_logprobs is None and weighs_rollouts(config, parts)
    return Experience(
        batch, advantages, old_logprobs, ref_logprobs, metrics, old_values, returns, gap_in_update
    )


def _corrected(advantages, old_logprobs, behaviour, batch: TrainBatch, correction):
    """Rollout correction over the whole batch: ``advantages`` times its weights, and the
    rejected tokens taken out of ``batch.response_mask`` (in place; the critic's loss reads
    it too). A rejected token then leaves the policy loss and its normaliser: ``token_mean``
    divides by the kept tokens, as verl's token-mean divides by the response mask's sum after
    rejection; under the ``seq_mean_*`` modes a wholly rejected response still counts in the
    number of responses, as a ``mask_truncated`` one does. A rejected sample keeps its place
    in the advantages already made (group baselines, whitening). Returns the advantages and
    the correction's tally."""
    corrected = correct(old_logprobs, behaviour, batch.response_mask, correction)
    if corrected.weights is not None:
        advantages = advantages * corrected.weights
    if corrected.keep is not None:
        batch.response_mask.mul_(corrected.keep)
    return advantages, corrected.tally


def served_logprobs(teacher, rollouts: list[Rollout], batch: TrainBatch) -> torch.Tensor:
    """A served teacher's logprobs of each sample's response tokens, as the batch's [N, R]."""
    rows = teacher.response_logprobs([(r.prompt_ids, r.response_ids) for r in rollouts])
    out = torch.zeros_like(batch.response_mask, dtype=torch.float32)
    for index, row in enumerate(rows):
        out[index, : len(row)] = torch.tensor(row, dtype=torch.float32)
    return out.to(batch.response_mask.device)


def teacher_rewards(teacher, old_logprobs, batch: TrainBatch, coef: float):
    """On-policy distillation's per-token rewards, ``coef * (log pi_teacher - log
    pi_student)`` of each sampled token ([N, R], 0 on padding), the student's logprobs being
    the old pass's when it ran, else the engine's that sampled them; and the batch's mean
    reverse KL estimate per token (``distill/reverse_kl``)."""
    student = old_logprobs if old_logprobs is not None else batch.behaviour_logprobs
    mask = batch.response_mask
    gap = (teacher - student) * mask
    return coef * gap, float(-gap.sum() / mask.sum().clamp(min=1))


def _advantages(
    config, parts, scores, token_rewards, batch, rollouts, values, baseline_scores, distill=None
):
    group_ids = torch.tensor([r.group_index for r in rollouts], device=scores.device)
    advantages, returns = get_advantage(config.algorithm.advantage)(
        scores,
        batch.response_mask,
        group_ids,
        parts.advantage_settings,
        token_rewards=token_rewards,
        values=values,
        baseline_scores=baseline_scores,
        distill_rewards=distill,
    )
    return advantages, returns  # [N, R] each
