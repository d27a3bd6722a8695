"""Advantage estimators, registered by name with the settings and inputs each takes.

An estimator turns one score per sample into per-token advantages and returns:
``(scores [N], response_mask [N, T], group_ids [N], *, ...) -> (advantages, returns)``, both
``[N, T]`` and zero on padding; samples drawn from the same prompt share a group id. Its
keyword arguments are its settings (``gamma``, ``lam``, ``norm_adv_by_std``) and the
per-batch tensors it needs beyond the scores (``token_rewards``, ``values``,
``baseline_scores``, default ``None``: one it needs and does not get raises
``ValueError``), each named in its ``@register_advantage`` line; the trainer calls every one
the same way through ``get_advantage`` (``advantage_registry.py``). Every estimator treats
its inputs as constants (nothing it returns carries a gradient).

On-policy distillation (``distill``) takes ``distill_rewards``: each response token's
``log pi_teacher - log pi_student`` of the token the student sampled.

With the KL to the reference in the reward (``algorithm.kl_in_reward``), ``token_rewards``
holds ``-beta * KL_t`` on every token plus the score on the last: ``reinforce_plus_plus``,
``remax`` and ``gae`` take each token's reward-to-go from them; the group estimators compare
whole samples, and their ``scores`` are the token rewards' sums.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from honing.algorithms.advantage_registry import register_advantage
from honing.algorithms.core import masked_whiten


def _check_batch(scores: Tensor, response_mask: Tensor, group_ids: Tensor) -> None:
    if scores.dim() != 1 or group_ids.dim() != 1 or response_mask.dim() != 2:
        raise ValueError(
            "expected scores [N], response_mask [N, T], group_ids [N]; got "
            f"{tuple(scores.shape)}, {tuple(response_mask.shape)}, {tuple(group_ids.shape)}"
        )
    if not (scores.shape[0] == response_mask.shape[0] == group_ids.shape[0]):
        raise ValueError(
            "scores, response_mask and group_ids disagree on the number of samples: "
            f"{scores.shape[0]}, {response_mask.shape[0]}, {group_ids.shape[0]}"
        )


def _required(estimator: str, name: str, value: Tensor | None, meaning: str) -> Tensor:
    if value is None:
        raise ValueError(f"advantage estimator {estimator!r} needs {name}= ({meaning})")
    return value


def _check_shape(name: str, tensor: Tensor, shape: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}; got {tuple(tensor.shape)}")


def _as_float(values: Tensor) -> Tensor:
    """``values`` detached, in their own float dtype or float32 for integer / bool input."""
    dtype = values.dtype if values.is_floating_point() else torch.float32
    return values.detach().to(dtype)


def _per_group_sum(group_ids: Tensor) -> Callable[[Tensor], Tensor]:
    """Returns ``group_sum(values [N]) -> [N]``: for each sample, the sum over its group.

    Group ids need not be contiguous or sorted. Finding the unique groups syncs with the host
    once; this runs once per batch, outside the loss.
    """
    unique_ids, group_index = torch.unique(group_ids, return_inverse=True)  # [G], [N]

    def group_sum(per_sample: Tensor) -> Tensor:
        sums = per_sample.new_zeros(unique_ids.numel()).index_add_(0, group_index, per_sample)
        return sums[group_index]  # [N]

    return group_sum


def _token_rewards(scores: Tensor, response_mask: Tensor, token_rewards: Tensor | None) -> Tensor:
    """``token_rewards`` if given, else each score on its row's last response token. ``[N, T]``"""
    if token_rewards is not None:
        _check_shape("token_rewards", token_rewards, tuple(response_mask.shape))
        return _as_float(token_rewards)
    scores = _as_float(scores)  # [N]
    mask = response_mask.bool()  # [N, T]
    positions = torch.arange(mask.shape[-1], device=mask.device)  # [T]
    last = torch.where(mask, positions, -1).amax(-1, keepdim=True)  # [N, 1]; -1 if empty
    return torch.where(positions == last, scores.unsqueeze(-1), 0.0)  # [N, T]


def _whiten_tokens(values: Tensor, response_mask: Tensor) -> Tensor:
    # Zero mean, unit variance over every response token of the batch; 0 on padding.
    return torch.where(response_mask.bool(), masked_whiten(values, response_mask), 0.0)


@register_advantage("grpo", settings=("norm_adv_by_std",))
def grpo(
    scores: Tensor,
    response_mask: Tensor,
    group_ids: Tensor,
    *,
    epsilon: float = 1e-6,
    norm_adv_by_std: bool = True,
) -> tuple[Tensor, Tensor]:
    """Group-relative advantages (GRPO, outcome supervision).

    Each sample's score is compared with the other samples of its group:
    ``A_i = (r_i - mean(r_group)) / (std(r_group) + epsilon)`` with the unbiased std
    (``torch.std``'s default, as in verl), and that one value is given to every response
    token. DeepSeekMath, section 4.1.2: https://arxiv.org/abs/2402.03300

    A group of one sample has nothing to compare with: its mean is its own score and its
    std is taken as 1, so its advantage is 0. Group ids need not be contiguous or sorted.
    Computing the unique groups syncs with the host once; this runs once per batch,
    outside the loss.

    Args:
        scores: ``[N]`` one score per sample (any numeric dtype).
        response_mask: ``[N, T]`` 1 on response tokens, 0 on padding.
        group_ids: ``[N]`` long; samples of the same prompt share an id.
        epsilon: Added to the std so all-equal groups give 0, not ``nan``.
        norm_adv_by_std: If False, return ``r_i - mean`` without dividing by the std
            (Dr. GRPO's fix for the std's difficulty bias, https://arxiv.org/abs/2503.20783).

    Returns:
        ``(advantages, returns)``, both ``[N, T]`` and zero on padding. Under outcome
        supervision the returns equal the advantages (a separate copy).
    """
    _check_batch(scores, response_mask, group_ids)
    scores = _as_float(scores)  # [N]
    group_sum = _per_group_sum(group_ids)
    group_size = group_sum(torch.ones_like(scores))  # [N]
    centered = scores - group_sum(scores) / group_size  # [N]
    if norm_adv_by_std:
        group_std = torch.sqrt(group_sum(centered**2) / (group_size - 1).clamp_min(1))  # [N]
        group_std = torch.where(group_size > 1, group_std, torch.ones_like(group_std))
        centered = centered / (group_std + epsilon)  # [N]
    advantages = centered.unsqueeze(-1) * response_mask.to(centered.dtype)  # [N, T]
    return advantages, advantages.clone()


@register_advantage("dr_grpo")
def dr_grpo(scores: Tensor, response_mask: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor]:
    """Dr. GRPO advantages: ``A_i = r_i - mean(r_group)``, not divided by the group's std.

    Dividing by the std up-weights prompts that are almost always solved or almost always
    failed; Dr. GRPO removes it (https://arxiv.org/abs/2503.20783). The paper's
    other fix, for the length bias, is not part of the advantage: it is the loss aggregation
    ``seq_mean_token_sum_norm`` (token losses summed, divided by the constant
    ``num_seqs * loss_scale_len``), chosen with ``algorithm.loss_agg``. Same values as
    ``grpo(..., norm_adv_by_std=False)``; a group of one gets 0.

    Args:
        scores: ``[N]`` one score per sample.
        response_mask: ``[N, T]`` 1 on response tokens, 0 on padding.
        group_ids: ``[N]``; samples of the same prompt share an id.

    Returns:
        ``(advantages, returns)``, both ``[N, T]``, equal, zero on padding.
    """
    return grpo(scores, response_mask, group_ids, norm_adv_by_std=False)


@register_advantage("rloo")
def rloo(scores: Tensor, response_mask: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor]:
    """REINFORCE leave-one-out: ``A_i = r_i - mean_{j != i} r_j`` over the sample's group.

    The baseline of each sample is the mean score of the other samples drawn for the same
    prompt, so it does not depend on the sample itself (unbiased). RLOO:
    https://arxiv.org/abs/2402.14740 . Equals ``n / (n - 1) * (r_i - mean)`` for a group of
    ``n``. A group of one has no other sample and gets 0.

    Args:
        scores: ``[N]`` one score per sample.
        response_mask: ``[N, T]`` 1 on response tokens, 0 on padding.
        group_ids: ``[N]``; samples of the same prompt share an id.

    Returns:
        ``(advantages, returns)``, both ``[N, T]``, equal, zero on padding.
    """
    _check_batch(scores, response_mask, group_ids)
    scores = _as_float(scores)  # [N]
    group_sum = _per_group_sum(group_ids)
    group_size = group_sum(torch.ones_like(scores))  # [N]
    others_mean = (group_sum(scores) - scores) / (group_size - 1).clamp_min(1)  # [N]
    centered = torch.where(group_size > 1, scores - others_mean, 0.0)  # [N]
    advantages = centered.unsqueeze(-1) * response_mask.to(centered.dtype)  # [N, T]
    return advantages, advantages.clone()


@register_advantage("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline(
    scores: Tensor, response_mask: Tensor, group_ids: Tensor
) -> tuple[Tensor, Tensor]:
    """Group-mean baseline, then whitening over the whole batch (REINFORCE++-baseline).

    ``A = whiten(r_i - mean(r_group))`` where the whitening (zero mean, unit unbiased
    variance) runs over every response token of the batch, as verl's
    ``reinforce_plus_plus_baseline``; REINFORCE++: https://arxiv.org/abs/2501.03262 . Unlike
    verl, a group of one is centred on its own score (0 before whitening, as in ``grpo``).
    Tokens weigh equally in the batch statistics, so longer responses weigh more.

    Args:
        scores: ``[N]`` one score per sample.
        response_mask: ``[N, T]`` 1 on response tokens, 0 on padding.
        group_ids: ``[N]``; samples of the same prompt share an id.

    Returns:
        ``(advantages, returns)``, both ``[N, T]``, equal, zero on padding.
    """
    centered, _ = grpo(scores, response_mask, group_ids, norm_adv_by_std=False)  # [N, T]
    advantages = _whiten_tokens(centered, response_mask)  # [N, T]
    return advantages, advantages.clone()


def _discounted_returns(rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    # G_t = r_t + gamma * G_next, right to left over response tokens; masked positions are
    # skipped (the return carries over them) and get 0.
    if gamma == 1.0:  # the undiscounted sum over k >= t, in one reversed cumulative sum
        kept = torch.where(mask, rewards, 0.0)  # [N, T]
        return torch.where(mask, kept.flip(-1).cumsum(-1).flip(-1), 0.0)
    returns = torch.zeros_like(rewards)  # [N, T]
    running = rewards.new_zeros(rewards.shape[0])  # [N]
    for t in reversed(range(rewards.shape[-1])):
        running = torch.where(mask[:, t], rewards[:, t] + gamma * running, running)
        returns[:, t] = running
    return torch.where(mask, returns, 0.0)


@register_advantage("reinforce_plus_plus", settings=("gamma",), inputs=("token_rewards",))
def reinforce_plus_plus(
    scores: Tensor,
    response_mask: Tensor,
    group_ids: Tensor,
    *,
    token_rewards: Tensor | None = None,
    gamma: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++: discounted token returns, whitened over the batch, no critic, no groups.

    ``G_t = sum_{k >= t} gamma^(k - t) r_k`` over response tokens, then
    ``A = whiten(G)`` over every response token of the batch. REINFORCE++:
    https://arxiv.org/abs/2501.03262 . The KL to the reference goes into the token rewards
    (``r_t = -beta * KL_t``, plus the score on the last token), which the caller builds.

    Args:
        scores: ``[N]`` one score per sample; used only when ``token_rewards`` is None.
        response_mask: ``[N, T]`` 1 on response tokens, 0 on padding.
        group_ids: ``[N]``; not used (the baseline is the batch mean).
        token_rewards: ``[N, T]`` per-token rewards. Default: each score on its row's last
            response token. Values on padding are ignored.
        gamma: Discount per response token.

    Returns:
        ``(advantages, returns)``, both ``[N, T]`` and zero on padding; the returns are
        ``G`` before whitening.
    """
    _check_batch(scores, response_mask, group_ids)
    mask = response_mask.bool()  # [N, T]
    rewards = _token_rewards(scores, response_mask, token_rewards)  # [N, T]
    returns = _discounted_returns(rewards, mask, gamma)  # [N, T]
    return _whiten_tokens(returns, response_mask), returns


@register_advantage("remax", inputs=("token_rewards", "baseline_scores"))
def remax(
    scores: Tensor,
    response_mask: Tensor,
    group_ids: Tensor,
    *,
    token_rewards: Tensor | None = None,
    baseline_scores: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """ReMax: the greedy response's score as the baseline, ``A_t = G_t - r_greedy(prompt)``.

    ReMax: https://arxiv.org/abs/2310.10505 . The caller generates one greedy
    (temperature 0) response per prompt, scores it, and passes that score for each sample
    of the prompt. ``G_t = sum_{k >= t} r_k`` is the token's undiscounted reward-to-go: with
    the score alone on the last token it is the score on every token, so ``A = r_i -
    r_greedy``; with a KL penalty in the token rewards each token carries the KL still to come,
    not the whole response's (both unbiased, the reward-to-go with less variance), as verl's
    ``compute_remax_outcome_advantage``.

    Args:
        scores: ``[N]`` one score per sample; used only when ``token_rewards`` is None.
        response_mask: ``[N, T]`` 1 on response tokens, 0 on padding.
        group_ids: ``[N]``; not used.
        token_rewards: ``[N, T]`` per-token rewards. Default: each score on its row's last
            response token. Values on padding are ignored.
        baseline_scores: ``[N]`` required; the greedy response's score for the sample's
            prompt.

    Returns:
        ``(advantages, returns)``, both ``[N, T]`` and zero on padding; the returns are
        ``G``, as in verl.

    Raises:
        ValueError: If ``baseline_scores`` is missing or not ``[N]``.
    """
    _check_batch(scores, response_mask, group_ids)
    baseline_scores = _required(
        "remax", "baseline_scores", baseline_scores, "[N] score of the greedy response"
    )
    _check_shape("baseline_scores", baseline_scores, tuple(scores.shape))
    mask = response_mask.bool()  # [N, T]
    rewards = _token_rewards(scores, response_mask, token_rewards)  # [N, T]
    returns = _discounted_returns(rewards, mask, 1.0)  # [N, T] sum over k >= t
    baseline = baseline_scores.to(returns.dtype).unsqueeze(-1)  # [N, 1]
    return torch.where(mask, returns - baseline, 0.0), returns


@register_advantage("gae", settings=("gamma", "lam"), inputs=("values", "token_rewards"))
def gae(
    scores: Tensor,
    response_mask: Tensor,
    group_ids: Tensor,
    *,
    values: Tensor | None = None,
    token_rewards: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation with a value model (PPO).

    ``delta_t = r_t + gamma * V_next - V_t`` and ``A_t = delta_t + gamma * lam * A_next``,
    right to left over response tokens. GAE, eq. 16: https://arxiv.org/abs/1506.02438 .
    ``V_next`` and ``A_next`` are those of the next response token: masked positions are
    skipped (nothing carries from padding, or from tokens the policy did not produce), and
    after the last response token both are 0. The returns, the critic's targets, are
    ``A + V`` before whitening; the advantages are then whitened over the batch's tokens.

    Args:
        scores: ``[N]`` one score per sample; used only when ``token_rewards`` is None.
        response_mask: ``[N, T]`` 1 on response tokens, 0 on padding.
        group_ids: ``[N]``; not used.
        values: ``[N, T]`` required; the critic's value of each response token's state.
        token_rewards: ``[N, T]`` per-token rewards (e.g. a KL penalty plus the score on the
            last token). Default: each score on its row's last response token.
        gamma: Discount per token.
        lam: GAE's lambda: 1 is the Monte Carlo return minus V, 0 the one-step TD error.

    Returns:
        ``(advantages, returns)``, both ``[N, T]`` and zero on padding.

    Raises:
        ValueError: If ``values`` is missing, or ``values`` / ``token_rewards`` are not
            shaped like ``response_mask``.
    """
    _check_batch(scores, response_mask, group_ids)
    values = _required("gae", "values", values, "[N, T] critic values of the response tokens")
    _check_shape("values", values, tuple(response_mask.shape))
    mask = response_mask.bool()  # [N, T]
    rewards = _token_rewards(scores, response_mask, token_rewards)  # [N, T]
    values = _as_float(values).to(torch.promote_types(rewards.dtype, values.dtype))  # [N, T]
    rewards = rewards.to(values.dtype)
    advantages = torch.zeros_like(values)  # [N, T]
    next_value = values.new_zeros(values.shape[0])  # [N]
    next_advantage = values.new_zeros(values.shape[0])  # [N]
    for t in reversed(range(values.shape[-1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]  # [N]
        next_advantage = torch.where(
            mask[:, t], delta + gamma * lam * next_advantage, next_advantage
        )
        next_value = torch.where(mask[:, t], values[:, t], next_value)
        advantages[:, t] = next_advantage
    returns = torch.where(mask, advantages + values, 0.0)  # [N, T]
    return _whiten_tokens(advantages, response_mask), returns


@register_advantage("distill", settings=("distill_score_coef",), inputs=("distill_rewards",))
def distill(
    scores: Tensor,
    response_mask: Tensor,
    group_ids: Tensor,
    *,
    distill_rewards: Tensor | None = None,
    distill_score_coef: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """On-policy distillation: the student's own samples, each token graded by a teacher.

    Token t's reward is ``log pi_teacher(y_t) - log pi_student(y_t)`` of the token the
    student sampled (``distill_rewards``, already scaled by ``algorithm.distill_coef``): a
    one-sample estimate of minus the reverse KL at that position, so pushing up its
    advantage-weighted logprob lowers ``KL(pi_student || pi_teacher)``. Each token's advantage
    is its own reward, not discounted over later tokens (Agarwal et al., GKD,
    https://arxiv.org/abs/2306.13649; Thinking Machines' on-policy distillation), plus
    ``distill_score_coef`` times the scores' GRPO advantage (the verifier's signal mixed in;
    0: the teacher alone).

    Returns:
        ``(advantages, returns)``, both ``[N, T]`` and zero on padding (the same values).
    """
    _check_batch(scores, response_mask, group_ids)
    rewards = _required("distill", "distill_rewards", distill_rewards, "the teacher's rewards")
    _check_shape("distill_rewards", rewards, tuple(response_mask.shape))
    mask = response_mask.to(_as_float(rewards).dtype)
    advantages = _as_float(rewards) * mask
    if distill_score_coef:
        outcome, _ = grpo(scores, response_mask, group_ids)
        advantages = advantages + distill_score_coef * outcome
    return advantages, advantages.clone()
