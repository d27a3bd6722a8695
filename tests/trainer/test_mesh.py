"""The named device mesh the data- and sequence-parallel groups come from."""

import pytest
import torch.distributed as dist

from honing.errors import ConfigError
from honing.trainer.layouts import Replicated
from honing.trainer.mesh import ParallelDims

from .ranks import on_ranks


def _groups(sequence: int) -> dict:
    layout = Replicated(dist.group.WORLD, sequence)
    mesh = layout.mesh
    return {
        "slot": layout.slot,
        "slots": layout.slots,
        "sp": dist.get_process_group_ranks(layout.sp.group) if layout.sp.world > 1 else [],
        "dp": dist.get_process_group_ranks(layout.dp),
        "names": mesh.mesh_dim_names if mesh is not None else None,
        "shape": tuple(mesh.shape) if mesh is not None else None,
    }


def test_four_ranks_in_two_sequence_slots_take_rows_and_columns_of_one_mesh(tmp_path):
    ranks = on_ranks(_groups, str(tmp_path / "rank"), 4, 2)
    for rank, got in enumerate(ranks):
        slot, position = divmod(rank, 2)
        assert got == {
            "slot": slot,
            "slots": 2,
            "sp": [2 * slot, 2 * slot + 1],  # the slot's consecutive ranks share a sequence
            "dp": [position, position + 2],  # one rank per slot, the same position in each
            "names": ("dp", "sp"),
            "shape": (2, 2),
        }


def test_without_sequence_parallelism_the_slots_are_the_ranks(tmp_path):
    ranks = on_ranks(_groups, str(tmp_path / "rank"), 2, 1)
    assert [r["slot"] for r in ranks] == [0, 1] and all(r["dp"] == [0, 1] for r in ranks)
    assert all(r["names"] is None for r in ranks)


def test_the_dimensions_must_divide_the_world():
    assert ParallelDims.of(6, 3) == ParallelDims(dp=2, sp=3)
    assert ParallelDims.of(6, 3).shape == (2, 3)
    with pytest.raises(ConfigError, match="4 torchrun ranks do not split into groups of 3"):
        ParallelDims.of(4, 3)
