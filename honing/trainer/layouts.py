"""How a trained module is laid out across processes: whole in this one (``OneProcess``),
whole on every torchrun rank (``Replicated``), or sharded over them (``sharded.Sharded``).

A layout is the trainer engine's (``trainer/engine.py``) and nothing else's: the pipeline
asks the engine, which asks its layout (``engine.make_layout`` picks one from the trainer's
strategy).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn


class Layout(ABC):
    """What differs between layouts; every pass and copy of a laid-out module goes through
    one of these.

    Attributes:
        rank, world: this process's rank and the number of processes sharing the module.
        collective: every pass of the module is run by every rank together (sharded).
        group: the torchrun process group (None in one process).
    """

    rank: int = 0
    world: int = 1
    collective: bool = False
    group = None

    def prepare(self, module: nn.Module) -> nn.Module:
        """The module laid out (sharded in place when the layout shards); before the
        optimizer is made."""
        return module

    @abstractmethod
    def rows(self, index: torch.Tensor, size: int) -> list[tuple[torch.Tensor, int]]:
        """This process's micro-batches of the mini-batch rows ``index``, each with its
        count of real rows (a sharded rank short of rows runs a masked copy of one)."""

    @abstractmethod
    def reduce_gradients(self, module: nn.Module) -> None:
        """After the micro-batches' backward passes: the gradients summed over processes."""

    @abstractmethod
    def reduce(self, totals: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Metric sums over every process sharing the module."""

    def gathered(self, pieces: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple]:
        """Each (name, tensor) piece whole (gathered from every rank when sharded)."""
        return iter(pieces)

    def load_whole(self, module: nn.Module, pieces) -> list[str]:
        """Copies whole tensors into ``module`` by name (this rank's shards of them when
        sharded); returns the names it does not have."""
        return copy_whole(module, pieces)

    def rowwise(self, compute: Callable, batch, width: int) -> torch.Tensor:
        """``compute(rows)`` ([rows, <= width]) over the batch as the layout runs a pass
        without gradient: here on the whole batch."""
        return compute(batch)


def copy_whole(module: nn.Module, pieces) -> list[str]:
    """Copies whole tensors into a whole module by name; returns the names it lacks."""
    own, unknown = module.state_dict(), []
    with torch.no_grad():
        for name, whole in pieces:
            if name in own:
                own[name].copy_(whole)
            else:
                unknown.append(name)
    return unknown


def sum_across(totals: dict[str, torch.Tensor], group) -> dict[str, torch.Tensor]:
    """Each total summed over the ranks of ``group`` (float64, one all-reduce)."""
    names = sorted(totals)
    values = torch.stack([torch.as_tensor(totals[n], dtype=torch.float64) for n in names])
    dist.all_reduce(values, group=group)
    return dict(zip(names, values, strict=True))


class OneProcess(Layout):
    """A module held whole by this one process."""

    def rows(self, index: torch.Tensor, size: int) -> list[tuple[torch.Tensor, int]]:
        return [(chunk, len(chunk)) for chunk in torch.split(index, size)]

    def reduce_gradients(self, module: nn.Module) -> None:
        return None

    def reduce(self, totals: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return totals


class Replicated(Layout):
    """torchrun data parallelism: the whole module on every rank of ``group``; rank r runs
    rows r, r + W, ... of each mini-batch, and the summed gradients (one all-reduce per
    optimizer step) give every rank the single-process step, so every rank holds the same
    weights and optimizer state. Passes without gradients run on one rank alone, as in one
    process."""

    def __init__(self, group):
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)

    def rows(self, index: torch.Tensor, size: int) -> list[tuple[torch.Tensor, int]]:
        if len(index) < self.world:
            raise ValueError(
                f"a mini-batch of {len(index)} sequences cannot be shared by {self.world} "
                "data-parallel ranks; raise trainer.mini_batch_size or use fewer ranks"
            )
        return [(c, len(c)) for c in torch.split(index[self.rank :: self.world], size)]

    def reduce_gradients(self, module: nn.Module) -> None:
        """All-reduce (sum) every trainable parameter's gradient, as one flat buffer."""
        params = [p for p in module.parameters() if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.group)
        for param, piece in zip(params, flat.split([g.numel() for g in grads]), strict=True):
            param.grad = piece.view_as(param)  # views of the one reduced buffer, no copy

    def reduce(self, totals: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return sum_across(totals, self.group)
