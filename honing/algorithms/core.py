"""Masked reductions and token-level log-probability helpers.

Every RL loss in honing reduces over response tokens only, so the reductions here take a
``mask`` of 0/1 (or bool) with the shape of ``values``. Masked-out positions are replaced by
zero before reducing, so padding that holds ``inf`` or ``nan`` cannot leak into the result or
its gradient. None of these functions syncs with the host (no ``.item()``), so they are safe
inside a loss.

Masks are taken as 0/1 indicators, not weights: fractional masks are not supported.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sums ``values`` where ``mask`` is set.

    Args:
        values: Any shape, e.g. ``[B, T]``.
        mask: Same shape as ``values``; 0/1 or bool.
        dim: Dimension to reduce; ``None`` reduces everything to a scalar.

    Returns:
        A scalar when ``dim`` is None, else ``values`` with ``dim`` removed.
    """
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    kept = torch.where(mask.bool(), values, zero)  # same shape as values
    return kept.sum() if dim is None else kept.sum(dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``values`` over the positions where ``mask`` is set.

    Where nothing is unmasked (the whole tensor, or one slice along ``dim``) the mean is 0,
    not ``nan``: an empty response contributes nothing instead of poisoning the batch.

    Args:
        values: Any shape, e.g. ``[B, T]``.
        mask: Same shape as ``values``; 0/1 or bool.
        dim: Dimension to reduce; ``None`` reduces everything to a scalar.

    Returns:
        A scalar when ``dim`` is None, else ``values`` with ``dim`` removed.
    """
    total = masked_sum(values, mask, dim)
    count = mask.to(values.dtype)
    count = count.sum() if dim is None else count.sum(dim)
    # With a 0/1 mask the count is a whole number, so clamping at 1 only changes empty slices,
    # whose total is already 0.
    return total / count.clamp_min(1)


def masked_var(values: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of ``values`` over the positions where ``mask`` is set (a scalar).

    Args:
        values: Any shape, e.g. ``[B, T]``.
        mask: Same shape as ``values``; 0/1 or bool.
        unbiased: Apply Bessel's correction ``n / (n - 1)``, as ``torch.var`` does by default.

    Returns:
        A scalar. With fewer than two unmasked elements the correction is skipped, so the
        result is 0 (one element) rather than ``nan`` or ``inf``.
    """
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        count = mask.to(values.dtype).sum()
        variance = variance * count / (count - 1).clamp_min(1)
    return variance


def masked_whiten(
    values: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> Tensor:
    """Scales ``values`` to unit variance (and zero mean) using masked statistics.

    The mean and variance come from the unmasked positions only; every position is then
    transformed, so callers should still multiply by ``mask`` where padding matters.
    As in TRL / torchtune ``whiten``.

    Args:
        values: Any shape, e.g. ``[B, T]``.
        mask: Same shape as ``values``; 0/1 or bool.
        shift_mean: If False, the mean is added back so only the scale changes.
        eps: Added to the variance before the square root.

    Returns:
        A tensor shaped like ``values``.
    """
    mean = masked_mean(values, mask)
    variance = masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(variance + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


CHUNK_ELEMENTS = 1 << 24  # logits per chunk in the row-wise helpers (64 MiB in float32)


def _per_sequence(fn: Callable[[Tensor], Tensor], logits: Tensor) -> Tensor:
    """Applies ``fn`` to ``[rows, T, V]`` chunks in float32 (or wider) and concatenates.

    A chunk holds as many sequences as fit in ``CHUNK_ELEMENTS`` logits (at least one), which
    bounds the temporary buffers (the upcast copy and the ``exp`` inside ``logsumexp``) with a
    large vocabulary, as TRL's ``selective_log_softmax`` does one row at a time, without paying
    a Python call per sequence when the vocabulary is small. The upcast keeps bf16 logits from
    losing precision in the normaliser.
    """
    compute_dtype = torch.promote_types(logits.dtype, torch.float32)
    per_row = max(1, logits[0].numel()) if len(logits) else 1
    rows = max(1, CHUNK_ELEMENTS // per_row)
    return torch.cat([fn(chunk.to(compute_dtype)) for chunk in logits.split(rows)])


def logprobs_from_logits(logits: Tensor, labels: Tensor) -> Tensor:
    """Log-probability of each label token: ``log_softmax(logits)[..., label]``.

    Computed as ``logit[label] - logsumexp(logits)`` so the full ``[B, T, V]`` log-softmax
    is never materialised.

    Args:
        logits: ``[B, T, V]`` unnormalised scores (any float dtype).
        labels: ``[B, T]`` token ids (long).

    Returns:
        ``[B, T]`` log-probabilities in float32 (float64 for float64 logits).
    """
    label_logits = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)  # [B, T]
    normaliser = _per_sequence(lambda row: torch.logsumexp(row, dim=-1), logits)  # [B, T]
    return label_logits.to(normaliser.dtype) - normaliser


def _entropy_of_rows(logits: Tensor) -> Tensor:
    # H = -sum p log p = logsumexp(z) - sum softmax(z) * z, avoiding log(0) for tiny p.
    probs = torch.softmax(logits, dim=-1)  # [rows, T, V]
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)  # [rows, T]


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy (in nats) of the categorical distribution at each position.

    Args:
        logits: ``[B, T, V]`` unnormalised scores (any float dtype).

    Returns:
        ``[B, T]`` entropies in float32 (float64 for float64 logits); ``log V`` for
        uniform logits.
    """
    return _per_sequence(_entropy_of_rows, logits)
