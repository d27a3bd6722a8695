"""A mixture-of-experts policy's routers under sequence parallelism (``sequence_parallel``).

Each rank of a sequence-parallel (SP) group runs its share of every sequence, so its routers
see its tokens only. What a logprob pass takes from the routers (``batch.RouterTap``) is made
whole here, so that the pass gives what one process's does:

- a plan to replay (routing replay) and a choice to compare with (the rollout's) are cut to
  the tokens this rank's routers see, in the order they see them (``RankTokens``);
- the experts the pass used (R2's record) are gathered into the batch's [B, P + R, L, k];
- the statistics are summed over the group: every rank of a slot holds the slot's sums, as
  it holds the slot's other metrics (the layout then reduces them over one rank per slot);
- the router logits kept for the router losses are gathered, the backward keeping this
  rank's rows: every rank computes the same losses over the slot's tokens, and the ranks'
  gradients sum to one process's, the contract of every SP pass.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from honing.models.moe import Routers
from honing.models.moe_stats import RouterStats
from honing.trainer.batch import RouterTap
from honing.trainer.packed import PackedLayout
from honing.trainer.ulysses.parallel import SequenceGroup


@dataclass(frozen=True)
class RankTokens:
    """The batch's tokens this rank's routers see, in the order they see them.

    Attributes:
        sources: [n] each token's place in the flattened [B * (P + R)] batch, -1 for the
            padding that makes the sequence a multiple of the group's size.
        real: [n] the tokens counted in the statistics and the router losses.
    """

    sources: torch.Tensor
    real: torch.Tensor

    @classmethod
    def of_rows(cls, batch, sp: SequenceGroup) -> RankTokens:
        """The model's own forward: the [B, T] rows, padded at their end to a multiple of N,
        columns ``sp.bounds`` of each (``parallel.local_hidden``)."""
        rows, width = batch.input_ids.shape
        start, stop = sp.bounds(sp.padded(width))
        device = batch.input_ids.device
        columns = torch.arange(start, stop, device=device)
        flat = torch.arange(rows, device=device)[:, None] * width + columns
        sources = torch.where(columns < width, flat, -1).reshape(-1)
        real = batch.attention_mask.reshape(-1).bool()[sources.clamp(min=0)] & (sources >= 0)
        return cls(sources, real)

    @classmethod
    def of_stream(cls, layout: PackedLayout, sp: SequenceGroup) -> RankTokens:
        """The packed forward: the slice ``sp.bounds`` of the flat stream, padded at its end
        (``packed``); every stream token is real."""
        length = layout.ids.shape[0]
        start, stop = sp.bounds(sp.padded(length))
        index = torch.arange(start, stop, device=layout.sources.device)
        sources = torch.where(index < length, layout.sources[index.clamp(max=length - 1)], -1)
        return cls(sources, sources >= 0)

    def plan(self, plan: torch.Tensor | None) -> torch.Tensor | None:
        """A [B, P + R, L, k] plan of the batch cut to these tokens: [n, L, k], -1 (the live
        choice stands) at padding."""
        if plan is None:
            return None
        flat = plan.reshape(-1, *plan.shape[2:])[self.sources.clamp(min=0)]
        return torch.where((self.sources >= 0)[:, None, None], flat, -1)


def routed_pass(
    run: Callable[[], tuple],
    routers: Routers,
    batch,
    sp: SequenceGroup,
    layout: PackedLayout | None,
    tap: RouterTap | None,
) -> tuple:
    """``run()`` (the group's logprob pass of ``batch``: the packed forward over ``layout``,
    or the model's own where it is None) with ``routers`` routing as ``batch`` plans, what
    ``tap`` asks for made whole over the group."""
    tap = tap or RouterTap()
    tokens = (
        RankTokens.of_stream(layout, sp) if layout is not None else RankTokens.of_rows(batch, sp)
    )
    stats = RouterStats() if tap.stats is not None else None
    session = routers.session(
        replay=tokens.plan(batch.replay),
        reference=tokens.plan(batch.rollout_routing),
        real=tokens.real,
        record=tap.record,
        stats=stats,
        keep_logits=tap.keep_logits,
    )
    with session:
        out = run()
    if stats is not None:
        tap.stats.include(_summed(stats, sp))
    tap.logits = [_GatherRows.apply(logits, sp) for logits in session.logits]
    if tap.record:
        [used] = session.recorded_calls()  # [n, L, k]
        tap.recorded = _whole_record(used, batch, layout, sp)
    return out


def _summed(stats: RouterStats, sp: SequenceGroup) -> RouterStats:
    """``stats`` summed over the group (one all-reduce)."""
    if sp.world == 1:
        return stats
    values = [getattr(stats, name) for name in RouterStats.FIELDS]
    flat = torch.cat([value.reshape(-1) for value in values])
    dist.all_reduce(flat, group=sp.group)
    pieces = flat.split([value.numel() for value in values])
    return RouterStats(
        **{
            name: piece.view_as(value)
            for name, piece, value in zip(RouterStats.FIELDS, pieces, values, strict=True)
        }
    )


def _whole_record(
    used: torch.Tensor, batch, layout: PackedLayout | None, sp: SequenceGroup
) -> torch.Tensor:
    """The experts each rank's routers used ([n, L, k], as many tokens on every rank) as the
    batch's [B, P + R, L, k], -1 where no token ran."""
    parts = [part.to(used.dtype) for part in sp.gathered(used.to(torch.int32))]
    rows, width = batch.input_ids.shape
    if layout is None:  # each part is [B, t] of the padded rows
        whole = torch.cat([part.view(rows, -1, *used.shape[1:]) for part in parts], 1)
        return whole[:, :width]
    stream = torch.cat(parts)[: layout.ids.shape[0]]
    return layout.to_batch(stream, -1).view(rows, width, *used.shape[1:])


class _GatherRows(torch.autograd.Function):
    """Every rank's rows [n_r, ...] (their counts may differ) -> [sum n_r, ...] in rank order.
    Every rank computes the same loss on them, so the backward keeps this rank's rows."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, sp: SequenceGroup) -> torch.Tensor:
        counts = torch.tensor([x.shape[0]], dtype=torch.long, device=x.device)
        counts = [int(c) for c in sp.gathered(counts)]
        ctx.start, ctx.count = sum(counts[: sp.rank]), x.shape[0]
        padded = x.new_zeros((max(counts), *x.shape[1:]), dtype=torch.float32)
        padded[: x.shape[0]] = x  # sent as float32: gloo need not carry half types
        parts = sp.gathered(padded)
        whole = torch.cat([part[:count] for part, count in zip(parts, counts, strict=True)])
        return whole.to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad[ctx.start : ctx.start + ctx.count], None
