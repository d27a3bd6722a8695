"""The one named device mesh a trained module's parallel groups come from.

The torchrun ranks sharing a module are laid out as a grid (torchtitan's ``ParallelDims``
does the same): ``dp`` data-parallel slots of ``sp`` consecutive ranks, the ranks of a slot
sharing each sequence (``trainer.sequence_parallel``). Slot s holds ranks sN .. sN + N - 1, so
a rank's ``sp`` group is its row of the grid and its ``dp`` group (one rank per slot, the
same position in each) its column. Every group is a dimension of one ``DeviceMesh`` built by
``init_device_mesh`` (or over a caller's group's ranks), so a further dimension (tensor or
expert parallelism) is one more name in ``DIMENSIONS`` and one more factor of the world,
not another set of hand-made ``new_group`` calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from honing.errors import ConfigError

DIMENSIONS = ("dp", "sp")


@dataclass(frozen=True)
class ParallelDims:
    """How many ranks each dimension spans; their product is the world."""

    dp: int
    sp: int = 1

    @classmethod
    def of(cls, world: int, sequence: int) -> ParallelDims:
        """The dimensions of ``world`` ranks with ``sequence`` ranks per sequence.

        Raises:
            ConfigError: the ranks do not split into groups of ``sequence``.
        """
        if sequence < 1 or world % sequence:
            raise ConfigError(
                f"trainer.sequence_parallel={sequence}: {world} torchrun ranks do not split "
                f"into groups of {sequence}"
            )
        return cls(dp=world // sequence, sp=sequence)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, name) for name in DIMENSIONS)


def device_mesh(group, dims: ParallelDims) -> DeviceMesh:
    """The mesh of ``dims`` over the ranks of ``group`` (the whole world: ``init_device_mesh``),
    its dimensions named ``DIMENSIONS``. Every rank of ``group`` must call it, in the same
    order as its other group creations (each dimension makes process groups)."""
    ranks = dist.get_process_group_ranks(group)
    device_type = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    if ranks == list(range(dist.get_world_size())):
        return init_device_mesh(device_type, dims.shape, mesh_dim_names=DIMENSIONS)
    grid = torch.tensor(ranks, dtype=torch.int).view(dims.shape)
    return DeviceMesh(device_type, grid, mesh_dim_names=DIMENSIONS)
