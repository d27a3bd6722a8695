"""Gloo ranks spawned by a test that share each sequence (Ulysses), each computing a result."""

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from honing.services.process import free_port
from honing.trainer.sequence_parallel import SequenceGroup


def on_ranks(compute, out: str, world: int = 2) -> list:
    """``compute(sp)`` (a module-level function: spawned ranks import it) on ``world`` ranks
    of one sequence-parallel group, one thread each; every rank's result, in rank order
    (saved under ``out``.<rank>)."""
    mp.spawn(_worker, args=(compute, free_port(), out, world), nprocs=world)
    return [torch.load(f"{out}.{rank}", weights_only=False) for rank in range(world)]


def _worker(rank: int, compute, port: int, out: str, world: int) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        torch.set_num_threads(1)
        torch.save(compute(SequenceGroup.of()), f"{out}.{rank}")
    finally:
        dist.destroy_process_group()
