"""Gloo ranks spawned by a test, each computing a result: how the distributed logic is tested
against one process."""

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from honing.host import exit_now
from honing.services.process import free_port


def on_ranks(compute, out: str, world: int = 2, *args) -> list:
    """``compute(*args)`` (a module-level function: spawned ranks import it) on ``world`` gloo
    ranks of one process group (``dist.group.WORLD``), one thread each; every rank's result,
    in rank order (saved under ``out``.<rank>)."""
    mp.spawn(_worker, args=(compute, args, free_port(), out, world), nprocs=world)
    return [torch.load(f"{out}.{rank}", weights_only=False) for rank in range(world)]


def _worker(rank: int, compute, args: tuple, port: int, out: str, world: int) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        torch.set_num_threads(1)
        torch.save(compute(*args), f"{out}.{rank}")
    finally:
        dist.destroy_process_group()
    exit_now()  # the result is saved: no teardown to abort in (a failure raises above)
