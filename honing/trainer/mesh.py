"""The one named device mesh a trained module's parallel groups come from.

The torchrun ranks sharing a module are laid out as a grid (torchtitan's ``ParallelDims``
does the same): ``dp`` data-parallel slots, each of ``sp`` x ``tp`` consecutive ranks. The
ranks of a slot run the same rows: under ``trainer.sequence_parallel`` they share each
sequence (``sp``), under ``trainer.tensor_parallel`` each holds a slice of every split weight
(``tp``, the innermost dimension: a tensor-parallel group is consecutive ranks, which on a
GPU node share the fastest links). Slot s holds ranks sN .. sN + N - 1 (N = sp x tp), so a
rank's ``sp`` or ``tp`` group is its row of the grid and its ``dp`` group (one rank per slot,
the same position in each) its column. Every group is a dimension of one ``DeviceMesh`` built
by ``init_device_mesh`` (or over a caller's group's ranks).

Under ``trainer.expert_parallel`` the slots themselves come in groups of ``ep`` consecutive
ones that share their experts (each holds E / ep of them, and every slot runs its own rows):
the outermost dimension is then two, ``edp`` (the groups of slots holding the same experts,
whose expert gradients are summed over it) and ``ep``, and the data-parallel ``dp`` is their
flattening. Slot s is then ``edp`` coordinate s // ep and ``ep`` coordinate s % ep.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from honing.errors import ConfigError

DIMENSIONS = ("dp", "sp", "tp")  # outermost first; dp is ("edp", "ep") under expert parallelism
KEYS = {
    "sp": "trainer.sequence_parallel",
    "tp": "trainer.tensor_parallel",
    "ep": "trainer.expert_parallel",
}


@dataclass(frozen=True)
class ParallelDims:
    """How many ranks each dimension spans (``dp``: data-parallel slots, of which ``ep``
    consecutive ones share their experts); the product of ``dp``, ``sp`` and ``tp`` is the
    world."""

    dp: int
    sp: int = 1
    tp: int = 1
    ep: int = 1

    @classmethod
    def of(cls, world: int, sequence: int = 1, tensor: int = 1, expert: int = 1) -> ParallelDims:
        """The dimensions of ``world`` ranks with ``sequence`` ranks per sequence, ``tensor``
        ranks per split weight and ``expert`` slots sharing their experts.

        Raises:
            ConfigError: the ranks do not split into groups of ``sequence`` x ``tensor``, or
                the slots into groups of ``expert``.
        """
        sizes = {"sp": sequence, "tp": tensor}
        slot = sequence * tensor
        if min(sizes.values()) < 1 or world % slot:
            keys = " x ".join(f"{KEYS[n]}={size}" for n, size in sizes.items() if size != 1)
            raise ConfigError(f"{keys}: {world} torchrun ranks do not split into groups of {slot}")
        slots = world // slot
        if expert < 1 or slots % expert:
            raise ConfigError(
                f"{KEYS['ep']}={expert}: {slots} data-parallel slots do not split into groups "
                f"of {expert}"
            )
        return cls(dp=slots, sp=sequence, tp=tensor, ep=expert)

    @property
    def names(self) -> tuple[str, ...]:
        """The mesh's dimensions: ``dp`` (``edp`` and ``ep`` under expert parallelism), and
        each other that spans more than one rank."""
        outer = ("edp", "ep") if self.ep > 1 else ("dp",)
        return outer + tuple(n for n in DIMENSIONS[1:] if getattr(self, n) > 1)

    @property
    def shape(self) -> tuple[int, ...]:
        sizes = {"dp": self.dp, "edp": self.dp // self.ep, "ep": self.ep}
        return tuple(sizes.get(name) or getattr(self, name) for name in self.names)


def device_mesh(group, dims: ParallelDims) -> DeviceMesh:
    """The mesh of ``dims`` over the ranks of ``group`` (the whole world: ``init_device_mesh``),
    its dimensions named ``dims.names`` (with ``dp`` the flattening of ``edp`` and ``ep``
    under expert parallelism). Every rank of ``group`` must call it, in the same order as its
    other group creations (each dimension makes process groups)."""
    ranks = dist.get_process_group_ranks(group)
    device_type = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    if ranks == list(range(dist.get_world_size())):
        mesh = init_device_mesh(device_type, dims.shape, mesh_dim_names=dims.names)
    else:
        grid = torch.tensor(ranks, dtype=torch.int).view(dims.shape)
        mesh = DeviceMesh(device_type, grid, mesh_dim_names=dims.names)
    if dims.ep > 1:
        mesh["edp", "ep"]._flatten("dp")  # torchtitan's way to a joined dimension
    return mesh
