"""How a trained module is laid out across processes: whole in this one (``OneProcess``),
whole on every torchrun rank (``Replicated``), or sharded over them (``sharded.Sharded``).

A layout is the trainer engine's (``trainer/engine.py``) and nothing else's: the pipeline
asks the engine, which asks its layout (``engine.make_layout`` picks one from the trainer's
strategy).

Micro-batches come by a count of rows (``size``) or, with a token budget (``budget`` > 0,
``trainer.max_tokens_per_micro``), by tokens: ``token_shares`` deals a mini-batch's rows to the
ranks so that each gets about as many tokens, and each rank packs its rows into micro-batches
of at most ``budget`` padded tokens (``pack_rows``).

With sequence parallelism (``trainer.sequence_parallel=N``, ``mesh_slots``) the torchrun
ranks form W/N data-parallel slots of N consecutive ranks: rows are dealt to the slots, every
rank of a slot runs the same rows and shares each sequence (Ulysses, ``sequence_parallel``),
its logprob passes (``Layout.logprobs``) give every rank of the slot the whole [B, R], and
each rank's gradient is its own tokens' part: the sum over all W ranks, which the gradient
reduction takes anyway, is the one-process gradient. Metrics, alike on a slot's ranks, are
summed over one rank per slot.

With tensor parallelism (``trainer.tensor_parallel=N``, ``trainer/tensor_parallel.py``) a
slot's N consecutive ranks each hold a slice of every split weight and run the same rows
together; the gradients are summed over the slots alone (a split weight's slice is its own
on each rank, a whole one's gradient alike on the slot's ranks), and the module counts as
sharded: every rank takes part in each pass, gather and checkpoint. Parameters split by
tensor parallelism are DTensors, which every copy in or out of a layout handles
(``whole_pieces``, ``copy_whole``).

With expert parallelism (``trainer.expert_parallel=N``, ``trainer/expert_parallel.py``) each
group of N consecutive data-parallel slots shares the routed experts of a mixture-of-experts
module, each slot's ranks holding E / N of them (DTensors split on the ``ep`` mesh dimension)
and every forward sending each token to the rank of its experts. Each slot still runs its own
rows; the module counts as sharded (every pass on every rank, as many micro-batches on each,
``even_rows``). An expert's gradient already sums every slot's tokens of its group: it is
summed over the groups (``edp``) alone, every other gradient as without experts.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from honing.errors import ConfigError
from honing.trainer.batch import response_logprobs
from honing.trainer.expert_parallel import ExpertShards, apply_expert_parallel
from honing.trainer.mesh import ParallelDims, device_mesh
from honing.trainer.tensor_parallel import parallelize
from honing.trainer.ulysses.packed import shared_logprobs
from honing.trainer.ulysses.parallel import SequenceGroup, use_ulysses


class Layout(ABC):
    """What differs between layouts; every pass and copy of a laid-out module goes through
    one of these.

    Attributes:
        rank, world: this process's rank and the number of processes sharing the module.
        collective: every pass of the module is run by every rank together (sharded).
        group: the torchrun process group (None in one process).
        sp: the ranks sharing each sequence with this one (alone without SP).
        slot, slots, dp: this rank's data-parallel slot, their number, and the group of one
            rank per slot that holds this one (``group`` itself without SP or TP).
        tp: the 1-D mesh of the ranks splitting each weight with this one (None without TP).
        ep: the 1-D mesh of the slots sharing their experts with this one's (None without
            EP); ``edp``: the group of the ranks holding the same experts as this one (None
            when it is this rank alone).
        mesh: the named device mesh ``dp``, ``sp``, ``tp`` and ``ep`` come from (None
            without SP, TP or EP).
    """

    rank: int = 0
    world: int = 1
    collective: bool = False
    group = None
    sp: SequenceGroup = SequenceGroup.alone()
    slot: int = 0
    slots: int = 1
    dp = None
    tp = None
    ep = None
    edp = None
    mesh = None

    @property
    def passes_together(self) -> bool:
        """Every pass without gradient is run by every rank together: sharded, or sequences
        shared by several ranks."""
        return self.collective or self.sp.world > 1

    def logprobs(self, model: nn.Module, batch, **options) -> tuple:
        """``response_logprobs(model, batch, **options)`` as this layout runs a logprob pass:
        under SP every rank of the slot on the same rows, each its share of every sequence
        (``ulysses/packed.shared_logprobs``), the whole [B, R] on each. A tensor-parallel
        module runs its own forward (the packed one reads its weights whole)."""
        if self.tp is not None:
            options = options | {"packed": False}
        if self.sp.world == 1:
            return response_logprobs(model, batch, **options)
        return shared_logprobs(model, batch, self.sp, **options)

    def values(self, module: nn.Module, batch) -> torch.Tensor:
        """``module(batch)`` (a critic's values, [B, R]) as this layout runs it: under SP every
        rank of the slot on the same rows, each its share of every sequence."""
        if self.sp.world == 1:
            return module(batch)
        return module(batch, sequence=self.sp)

    def prepare(self, module: nn.Module) -> nn.Module:
        """The module laid out (sharded in place when the layout shards); before the
        optimizer is made."""
        return module

    @abstractmethod
    def rows(
        self, index: torch.Tensor, size: int, tokens: torch.Tensor | None = None, budget: int = 0
    ) -> list[tuple[torch.Tensor, int]]:
        """This process's micro-batches of the mini-batch rows ``index``, each with its
        count of real rows (a sharded rank short of rows runs a masked copy of one): of
        ``size`` rows, or with ``budget`` > 0 of at most ``budget`` padded tokens, the rows
        dealt to the ranks by their ``tokens`` ([len(index)], aligned with ``index``)."""

    @abstractmethod
    def reduce_gradients(self, module: nn.Module) -> None:
        """After the micro-batches' backward passes: the gradients summed over processes."""

    @abstractmethod
    def reduce(self, totals: dict[str, torch.Tensor], how: str = "sum") -> dict[str, torch.Tensor]:
        """Metric sums (``how="max"``: elementwise maxima) over every process sharing the
        module."""

    def gathered(self, pieces: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple]:
        """Each (name, tensor) piece whole (``whole_pieces``; a sharded module's, as its
        export writes them, with a tied tensor once)."""
        return whole_pieces(pieces, tied_once=self.collective)

    def load_whole(self, module: nn.Module, pieces) -> list[str]:
        """Copies whole tensors into ``module`` by name (this rank's shards of them when
        sharded); returns the names it does not have."""
        return copy_whole(module, pieces)

    def rowwise(self, compute: Callable, batch, width: int) -> torch.Tensor:
        """``compute(rows)`` ([rows, <= width]) over the batch as the layout runs a pass
        without gradient: here on the whole batch."""
        return compute(batch)


def whole_pieces(
    pieces: Iterable[tuple[str, torch.Tensor]], tied_once: bool = False
) -> Iterator[tuple]:
    """Each (name, tensor) piece whole: a DTensor (a shard of FSDP's or a slice of tensor
    parallelism's) gathered from every rank as its turn comes (every rank takes part and gets
    it). A DTensor tied to one already given (embeddings, head) is not given again, nor with
    ``tied_once`` a plain tensor (whole on every rank under tensor parallelism)."""
    seen = set()
    for name, tensor in pieces:
        dtensor = isinstance(tensor, DTensor)
        if dtensor or tied_once:
            local = tensor.to_local() if dtensor else tensor
            storage = (local.untyped_storage().data_ptr(), local.storage_offset())
            if storage in seen:
                continue
            seen.add(storage)
        yield name, tensor.full_tensor() if dtensor else tensor


def copy_whole(module: nn.Module, pieces) -> list[str]:
    """Copies whole tensors into ``module`` by name, one at a time: into a DTensor parameter
    its own part (every rank reads the same pieces and keeps its part; a piece that is a
    DTensor already, read from shards, is copied as it is). Returns the names it lacks."""
    own, unknown = module.state_dict(), []
    with torch.no_grad():
        for name, whole in pieces:
            target = own.get(name)
            if target is None:
                unknown.append(name)
            elif isinstance(whole, DTensor):
                if whole is not target:
                    target.to_local().copy_(whole.to_local())
            elif isinstance(target, DTensor):
                whole = whole.to(device=target.device, dtype=target.dtype)
                part = distribute_tensor(
                    whole, target.device_mesh, target.placements, src_data_rank=None
                )
                target.to_local().copy_(part.to_local())
            else:
                target.copy_(whole)
    return unknown


def reduce_across(
    totals: dict[str, torch.Tensor], group, how: str = "sum"
) -> dict[str, torch.Tensor]:
    """Each total (a number or a tensor of one shape on every rank) summed, or its elementwise
    maximum for ``how="max"``, over the ranks of ``group`` (float64, one all-reduce)."""
    names = sorted(totals)
    values = [torch.as_tensor(totals[n], dtype=torch.float64) for n in names]
    flat = torch.cat([v.reshape(-1) for v in values])
    dist.all_reduce(flat, op=REDUCE_OPS[how], group=group)
    pieces = flat.split([v.numel() for v in values])
    return {n: p.view_as(v) for n, p, v in zip(names, pieces, values, strict=True)}


REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


def mesh_slots(layout: Layout, sequence: int = 1, tensor: int = 1, expert: int = 1) -> None:
    """Sets ``layout``'s ``mesh``, ``sp``, ``tp``, ``ep``, ``edp``, ``slot``, ``slots`` and
    ``dp`` for ``sequence`` ranks per sequence, ``tensor`` ranks per split weight and
    ``expert`` slots sharing their experts over its ``group``: slot s is ranks sN .. sN + N - 1
    (N = sequence x tensor), the groups the dimensions of one named mesh
    (``trainer/mesh.py``). Without any, the slots are the ranks and ``dp`` is ``group`` itself
    (no mesh is made)."""
    dims = ParallelDims.of(layout.world, sequence, tensor, expert)
    layout.slot, layout.slots, layout.dp = layout.rank, layout.world, layout.group
    if dims.names == ("dp",):
        return
    layout.mesh = device_mesh(layout.group, dims)
    layout.slots, layout.dp = dims.dp, layout.mesh.get_group("dp")
    layout.slot = layout.mesh["dp"].get_local_rank()
    if dims.sp > 1:
        layout.sp = SequenceGroup.of(layout.mesh.get_group("sp"))
    if dims.tp > 1:
        layout.tp = layout.mesh["tp"]
    if dims.ep > 1:
        layout.ep = layout.mesh["ep"]
        layout.edp = layout.mesh.get_group("edp") if dims.dp > dims.ep else None


def with_experts(module: nn.Module, mesh) -> nn.Module:
    """``module``'s routed experts (a causal LM's, or its ``backbone``'s) shared by the slots
    of the 1-D ``ep`` ``mesh`` (``trainer/expert_parallel.py``); unchanged without a mesh, or
    for a module without routed experts (a dense critic: the policy's are checked when it
    loads)."""
    from honing.models.moe import routers_of

    model = getattr(module, "backbone", module)
    if mesh is not None and routers_of(model) is not None:
        apply_expert_parallel(model, mesh)
    return module


def expert_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The expert-parallel parameters of ``module`` (none without expert parallelism)."""
    shards = ExpertShards.of(module)
    return [] if shards is None else shards.parameters()


def reduce_experts(module: nn.Module, group) -> None:
    """Sums the expert-parallel gradients of ``module`` over ``group`` (the ranks holding the
    same experts: ``edp``; nothing to do without one), as one flat buffer."""
    grads = [p.grad.to_local() for p in expert_parameters(module) if p.grad is not None]
    if group is None or not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    with torch.no_grad():
        for grad, piece in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            grad.copy_(piece.view_as(grad))


def even_rows(
    layout: Layout, index: torch.Tensor, size: int, tokens: torch.Tensor | None, budget: int
) -> list[tuple[torch.Tensor, int]]:
    """This slot's rows of ``index`` (rows slot, slot + S, ... in micro-batches of ``size``,
    or with a token ``budget`` its share packed by tokens), as many micro-batches on every
    slot, for a module whose passes run on every rank together: a slot with fewer repeats a
    row of its own, masked (the second item: real rows)."""
    if len(index) < layout.slots:
        raise ValueError(
            f"a mini-batch of {len(index)} sequences cannot be shared by {layout.slots} "
            "data-parallel ranks; raise trainer.mini_batch_size or use fewer ranks"
        )
    if budget:
        shares = token_shares(index, tokens, layout.slots, budget)
        mine = [(chunk, len(chunk)) for chunk in shares[layout.slot]]
        shortest = mine[-1][0][-1:]  # the cheapest row to run masked
        most = max(len(share) for share in shares)
        return mine + [(shortest, 0)] * (most - len(mine))
    mine = index[layout.slot :: layout.slots]
    most = -(-len(index) // layout.slots)  # the largest share
    padded = torch.cat([mine, mine[:1].repeat(most - len(mine))])
    out = []
    for start in range(0, most, size):
        chunk = padded[start : start + size]
        out.append((chunk, max(0, min(len(chunk), len(mine) - start))))
    return out


def with_ulysses(module: nn.Module, sequence: int) -> nn.Module:
    """``module`` with the Ulysses attention for ``sequence`` ranks (unchanged for 1): a causal
    LM's, or its ``backbone``'s (a critic); what it refuses, as a ``ConfigError``."""
    if sequence == 1:
        return module
    try:
        use_ulysses(getattr(module, "backbone", module), sequence)
    except ValueError as err:
        raise ConfigError(f"trainer.sequence_parallel={sequence}: {err}") from None
    return module


def rowwise_by_slots(layout: Layout, compute: Callable, batch, width: int) -> torch.Tensor:
    """``compute(rows)`` of this rank's slot's rows (``layout.rows``: as many on every slot,
    a short one's padded), every slot's results gathered into the batch's [B, width] on every
    rank."""
    count = len(batch)
    index = torch.arange(count)
    most = max(-(-count // layout.slots), 1)
    [(mine, _)] = layout.rows(index, most)
    local = compute(batch.select(mine))  # [b, w <= width]
    padded = torch.zeros(most, width, dtype=local.dtype, device=local.device)
    padded[: len(local), : local.shape[1]] = local
    parts = [torch.empty_like(padded) for _ in range(layout.slots)]
    dist.all_gather(parts, padded.contiguous(), group=layout.dp)
    out = torch.zeros(count, width, dtype=local.dtype, device=local.device)
    for slot, part in enumerate(parts):
        rows = index[slot :: layout.slots]
        out[rows] = part[: len(rows)]
    return out


def pack_rows(index: torch.Tensor, tokens: torch.Tensor, budget: int) -> list[torch.Tensor]:
    """``index`` cut into micro-batches of at most ``budget`` padded tokens: the rows longest
    first, each micro-batch as many as fit when every one of them costs its first (longest)
    row's ``tokens``, the width they are padded to; a row over the budget goes alone."""
    order = torch.argsort(tokens, descending=True, stable=True).tolist()
    counts = tokens.tolist()
    micro_batches, start = [], 0
    while start < len(order):
        fit = max(1, budget // max(int(counts[order[start]]), 1))
        micro_batches.append(index[order[start : start + fit]])
        start += fit
    return micro_batches


def deal_rows(tokens: torch.Tensor, world: int) -> list[list[int]]:
    """Positions in ``tokens`` dealt to ``world`` ranks, longest first, each to the rank with
    the fewest tokens so far (then the fewest rows, then the lowest rank): greedy longest
    processing time, which leaves the ranks' totals within the longest row of each other."""
    order = torch.argsort(tokens, descending=True, stable=True).tolist()
    counts = tokens.tolist()
    shares: list[list[int]] = [[] for _ in range(world)]
    loads = [0] * world
    for position in order:
        rank = min(range(world), key=lambda r: (loads[r], len(shares[r]), r))
        shares[rank].append(position)
        loads[rank] += counts[position]
    return shares


def token_shares(
    index: torch.Tensor, tokens: torch.Tensor, world: int, budget: int
) -> list[list[torch.Tensor]]:
    """Every rank's micro-batches of the rows ``index`` under a token ``budget``: the rows
    dealt by their ``tokens`` (``deal_rows``), each rank's packed (``pack_rows``). Every rank
    computes all of them alike from the same mini-batch."""
    if tokens is None or len(tokens) != len(index):
        raise ValueError("a token budget needs every row's token count, aligned with the rows")
    out = []
    for share in deal_rows(tokens, world):
        positions = torch.tensor(share, dtype=torch.long)
        out.append(pack_rows(index[positions], tokens[positions], budget))
    return out


class OneProcess(Layout):
    """A module held whole by this one process."""

    def rows(
        self, index: torch.Tensor, size: int, tokens: torch.Tensor | None = None, budget: int = 0
    ) -> list[tuple[torch.Tensor, int]]:
        if budget:
            [mine] = token_shares(index, tokens, 1, budget)
        else:
            mine = torch.split(index, size)
        return [(chunk, len(chunk)) for chunk in mine]

    def reduce_gradients(self, module: nn.Module) -> None:
        return None

    def reduce(self, totals: dict[str, torch.Tensor], how: str = "sum") -> dict[str, torch.Tensor]:
        return totals


class Replicated(Layout):
    """torchrun data parallelism: the whole module on every rank of ``group``; slot s runs
    rows s, s + S, ... of each mini-batch (under a token budget, its share of the rows dealt
    by their tokens; a slot is one rank, or ``sequence`` ranks sharing each sequence), and
    the summed gradients (one all-reduce over every rank per optimizer step) give every rank
    the single-process step, so every rank holds the same weights and optimizer state.
    Passes without gradients run on one rank alone, as in one process; under SP every rank
    runs them together, each slot its rows (``rowwise_by_slots``).

    With ``tensor`` > 1 the module is whole on each slot, split over its ranks (tensor
    parallelism): it counts as sharded (``collective``), every pass runs on every rank, and
    the gradients are summed over the slots (``dp``) alone. With ``expert`` > 1 groups of
    that many slots share the routed experts (expert parallelism): sharded too, every slot
    runs as many micro-batches (``even_rows``), and the experts' gradients are summed over
    the ranks holding the same experts (``edp``)."""

    def __init__(self, group, sequence: int = 1, tensor: int = 1, expert: int = 1):
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        mesh_slots(self, sequence, tensor, expert)
        # each rank holds a slice of the split weights, or its share of the experts
        self.collective = self.tp is not None or self.ep is not None

    def prepare(self, module: nn.Module) -> nn.Module:
        module = parallelize(with_ulysses(module, self.sp.world), self.tp)
        return with_experts(module, self.ep)

    def rows(
        self, index: torch.Tensor, size: int, tokens: torch.Tensor | None = None, budget: int = 0
    ) -> list[tuple[torch.Tensor, int]]:
        if self.ep is not None:
            return even_rows(self, index, size, tokens, budget)
        if len(index) < self.slots:
            raise ValueError(
                f"a mini-batch of {len(index)} sequences cannot be shared by {self.slots} "
                "data-parallel ranks; raise trainer.mini_batch_size or use fewer ranks"
            )
        if budget:
            mine = token_shares(index, tokens, self.slots, budget)[self.slot]
        else:
            mine = torch.split(index[self.slot :: self.slots], size)
        return [(c, len(c)) for c in mine]

    def reduce_gradients(self, module: nn.Module) -> None:
        """All-reduce (sum) every trainable parameter's gradient, as one flat buffer, over
        every rank (over the slots under tensor parallelism: a DTensor's local slice); an
        expert-parallel one's over ``edp`` (``reduce_experts``)."""
        experts = {id(p) for p in expert_parameters(module)}
        reduce_experts(module, self.edp)
        params = [p for p in module.parameters() if p.requires_grad and id(p) not in experts]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        flat = torch.cat([g.reshape(-1) for g in local])
        dist.all_reduce(flat, group=self.group if self.tp is None else self.dp)
        pieces = flat.split([g.numel() for g in local])
        with torch.no_grad():
            for param, grad, part, piece in zip(params, grads, local, pieces, strict=True):
                if isinstance(grad, DTensor):
                    part.copy_(piece.view_as(part))
                    param.grad = grad
                else:
                    param.grad = piece.view_as(param)  # views of the reduced buffer, no copy

    def reduce(self, totals: dict[str, torch.Tensor], how: str = "sum") -> dict[str, torch.Tensor]:
        return reduce_across(totals, self.dp, how)

    def rowwise(self, compute: Callable, batch, width: int) -> torch.Tensor:
        if not self.passes_together:
            return compute(batch)
        return rowwise_by_slots(self, compute, batch, width)
