"""Ulysses sequence parallelism for honing's packed forward (``honing.trainer.packed``).

The flat stream of a batch (each distinct prompt once, then each row's response inputs) is
cut into N contiguous slices, one a rank, padded at its end to a multiple of N with token 0
at position 0 (no attention slot reads it and it predicts nothing). Each rank runs its slice's
per-token work; in every block the attention step exchanges q/k/v for the whole stream's
tokens and H/N heads (``parallel.to_sequence``), runs the packed block attention over
them (``packed_attention``: each row's prompt and response so far), and exchanges its output
back. The head runs on the rank's own predictors; the [B, R] logprobs are summed over the
group (a rank holds zeros at the other ranks' tokens) with a backward that passes the gradient
through unchanged: every rank computes the same loss from them, and the ranks' parameter
gradients sum to one process's, as in ``parallel``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from honing.models.llama_block import norm_of, rms_norm, unwrap
from honing.trainer.batch import routed
from honing.trainer.packed import (
    PackedLayout,
    layout_of,
    packed_attention,
    packed_hidden,
    packed_supported,
)
from honing.trainer.ulysses.parallel import (
    SequenceGroup,
    check_model,
    local_head,
    repeat_kv,
    sequence_parallel_logprobs,
    to_heads,
    to_sequence,
)
from honing.trainer.ulysses.routing import routed_pass


class _SumOver(torch.autograd.Function):
    """The sum over the group of each rank's part. Every rank computes the same loss on the
    sum, so each part's gradient is the sum's own (no exchange in the backward)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, sp: SequenceGroup) -> torch.Tensor:
        x = x.clone()
        if sp.world > 1:
            dist.all_reduce(x, group=sp.group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _exchanged(sp: SequenceGroup, length: int):
    """The packed attention step over a ``length``-token stream whose slices the ranks hold."""
    padded = sp.padded(length)

    def attend(q, k, v, layout: PackedLayout, scaling: float) -> torch.Tensor:
        k, v = repeat_kv(k, v, sp, dim=1)
        parts = [x.transpose(0, 1)[None] for x in (q, k, v)]  # [1, h, n, D]
        q, k, v = (x[0].transpose(0, 1)[:length] for x in to_sequence(parts, sp))  # [N, h/N, D]
        out = packed_attention(q, k, v, layout, scaling)  # [N, H/N * D]
        out = F.pad(out, (0, 0, 0, padded - length)).view(padded, q.shape[1], -1)
        return to_heads(out.transpose(0, 1)[None], sp)[0].flatten(1)  # [n, H*D]

    return attend


def packed_sequence_parallel_logprobs(
    model: nn.Module, batch, sp: SequenceGroup, **options
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``packed_response_logprobs`` with the stream shared by the SP group: the whole [B, R]
    logprobs (and entropy) on every rank, 0 at padding. ``options`` are
    ``sequence_parallel_logprobs``'s (temperature, with_entropy, entropy_grad)."""
    reason = packed_supported(model)
    if reason is not True:
        raise ValueError(f"the packed forward cannot take this model: {reason}")
    check_model(unwrap(model), sp.world)
    layout = layout_of(model, batch)
    length = layout.ids.shape[0]
    padded = sp.padded(length)
    start, stop = sp.bounds(padded)
    ids = F.pad(layout.ids, (0, padded - length))[start:stop]
    positions = F.pad(layout.positions, (0, padded - length))[start:stop]
    x = packed_hidden(model, ids, positions, layout, _exchanged(sp, length))  # [n, E]
    mine = (layout.predictors >= start) & (layout.predictors < stop)  # [T]
    base = unwrap(model)
    hidden = rms_norm(x[layout.predictors[mine] - start], norm_of(base.model.norm))
    real = batch.response_real.bool()
    logprobs, entropy = local_head(base, hidden, batch.responses[real][mine], **options)

    def whole(values: torch.Tensor) -> torch.Tensor:
        part = torch.zeros(mine.shape, dtype=values.dtype, device=values.device)
        flat = _SumOver.apply(part.masked_scatter(mine, values), sp)  # [T]
        return torch.zeros(real.shape, dtype=flat.dtype, device=flat.device).masked_scatter(
            real, flat
        )

    return whole(logprobs), None if entropy is None else whole(entropy)


def shared_logprobs(
    model: nn.Module, batch, sp: SequenceGroup, *, packed: bool = False, tap=None, **options
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``response_logprobs``' pass with each row shared by the SP group: the packed forward
    where ``packed`` and the model takes it, else the model's own; ``options``: temperature,
    with_entropy, entropy_grad. A mixture-of-experts model routes as ``batch`` plans, and
    ``tap`` takes what the group's routers saw (``routing``)."""
    packed = packed and packed_supported(model) is True

    def run():
        if packed:
            return packed_sequence_parallel_logprobs(model, batch, sp, **options)
        return sequence_parallel_logprobs(model, batch, sp, **options)

    routers = routed(model, batch, tap)
    if routers is None:
        return run()
    layout = layout_of(model, batch) if packed else None
    return routed_pass(run, routers, batch, sp, layout, tap)
