"""Advantage estimators, registered by name.

An estimator turns one score per sample into per-token advantages and returns. Every
estimator has the same call convention, so the trainer picks one by the config name
(``algorithm.advantage``) and never branches on it::

    advantages, returns = get_advantage(name)(scores, response_mask, group_ids, **options)

where ``scores`` is ``[N]``, ``response_mask`` is ``[N, T]``, ``group_ids`` is ``[N]``
(samples drawn from the same prompt share an id) and ``options`` are the estimator's own
keyword-only settings. To add one, write such a function and decorate it with
``@register_advantage("name")``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

AdvantageEstimator = Callable[..., tuple[Tensor, Tensor]]

ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {}


def register_advantage(name: str) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    """Decorator that adds an estimator to ``ADVANTAGE_ESTIMATORS`` under ``name``.

    Raises:
        ValueError: If ``name`` is already taken.
    """

    def decorator(fn: AdvantageEstimator) -> AdvantageEstimator:
        if name in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ADVANTAGE_ESTIMATORS[name] = fn
        return fn

    return decorator


def get_advantage(name: str) -> AdvantageEstimator:
    """Returns the estimator registered under ``name``.

    Raises:
        ValueError: If no estimator has that name; the message lists the known ones.
    """
    try:
        return ADVANTAGE_ESTIMATORS[name]
    except KeyError:
        choices = ", ".join(sorted(ADVANTAGE_ESTIMATORS))
        raise ValueError(
            f"unknown advantage estimator {name!r}; choose one of: {choices}"
        ) from None


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


@register_advantage("grpo")
def grpo(
    scores: Tensor,
    response_mask: Tensor,
    group_ids: Tensor,
    *,
    epsilon: float = 1e-6,
    norm_by_std: bool = True,
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
        norm_by_std: If False, return ``r_i - mean`` without dividing by the std
            (Dr. GRPO's fix for the std's difficulty bias, https://arxiv.org/abs/2503.20783).

    Returns:
        ``(advantages, returns)``, both ``[N, T]`` and zero on padding. Under outcome
        supervision the returns equal the advantages (a separate copy).
    """
    _check_batch(scores, response_mask, group_ids)
    dtype = scores.dtype if scores.is_floating_point() else torch.float32
    scores = scores.to(dtype)  # [N]
    unique_ids, group_index = torch.unique(group_ids, return_inverse=True)  # [G], [N]
    num_groups = unique_ids.numel()

    def group_sum(per_sample: Tensor) -> Tensor:
        return torch.zeros(num_groups, dtype=dtype, device=scores.device).index_add_(
            0, group_index, per_sample
        )  # [G]

    group_size = group_sum(torch.ones_like(scores))  # [G]
    group_mean = group_sum(scores) / group_size  # [G]
    centered = scores - group_mean[group_index]  # [N]
    if norm_by_std:
        squared_deviation = group_sum(centered**2)  # [G]
        group_std = torch.sqrt(squared_deviation / (group_size - 1).clamp_min(1))  # [G]
        group_std = torch.where(group_size > 1, group_std, torch.ones_like(group_std))
        centered = centered / (group_std[group_index] + epsilon)  # [N]
    advantages = centered.unsqueeze(-1) * response_mask.to(dtype)  # [N, T]
    return advantages, advantages.clone()
