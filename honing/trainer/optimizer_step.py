"""The optimizer step of a laid-out module (``TrainedModule.step``): the gradients' norm as
one process holding them whole would compute it, whatever their placements (FSDP's shards,
tensor parallelism's slices, plain tensors), the clip, the step skipped when the norm is not
finite, and the optimizer's state moved to and from the host around it.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from honing.trainer.sharded import local_bytes


def clip_and_step(module: nn.Module, optimizer, grad_clip: float) -> tuple[torch.Tensor, bool]:
    """Clips the gradients to ``grad_clip`` (0: off) and steps, unless their norm is not
    finite (a NaN/inf gradient would poison every weight through Adam): then they are
    dropped. Returns the norm and whether the step was taken; one host sync."""
    norm = total_norm([p.grad for p in module.parameters() if p.grad is not None])
    if grad_clip > 0:
        scale = torch.clamp(grad_clip / (norm + 1e-6), max=1.0)  # as clip_grad_norm_
        with torch.no_grad():
            for param in module.parameters():
                if param.grad is not None:
                    grad = param.grad
                    (grad.to_local() if isinstance(grad, DTensor) else grad).mul_(scale)
    if not torch.isfinite(norm):
        optimizer.zero_grad(set_to_none=True)
        return norm, False
    optimizer.step()
    return norm, True


def total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all of ``grads`` together, as one process holding them whole would
    compute it: each mesh's DTensors (FSDP's shards, tensor parallelism's slices, or both)
    normed together over their ranks, plain tensors (alike on every rank) as they are."""
    groups: dict = {}
    for grad in grads:
        groups.setdefault(grad.device_mesh if isinstance(grad, DTensor) else None, []).append(grad)
    norms = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm(group)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.stack(norms))


def move_optimizer_state(optimizer, device: torch.device) -> int:
    """Moves the optimizer's tensors (Adam's moments) to ``device`` (pinned host memory when
    CUDA is there to copy back from); returns the bytes moved."""
    moved = 0
    pin = device.type == "cpu" and torch.cuda.is_available()
    for state in optimizer.state.values():
        for key, value in state.items():
            if torch.is_tensor(value) and value.dim() > 0:
                whole = not isinstance(value, DTensor)  # a shard moves as its DTensor
                state[key] = value.to(device, non_blocking=not (pin and whole))
                if pin and whole:
                    state[key] = state[key].pin_memory()
                moved += local_bytes([value])
    return moved
