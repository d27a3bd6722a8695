"""Trainer engines: one per trained module (the policy, the critic, the MTP heads).

An engine owns its module, optimizer and learning-rate schedule, and is the only thing that
knows how the module is laid out across processes. The update code asks it for what depends
on that layout and nothing else:

- ``rows(index, size)``: this process's micro-batches of a mini-batch's rows;
- ``step(grad_clip)``: after the micro-batches' backward passes, the gradients reduced
  across processes, clipped, and the optimizer step, skipped when their norm is not finite;
- ``reduce(totals)``: metric sums over every process;
- ``weights(...)``: the module's weights for the rollout engines, as buckets of (name,
  tensor) pieces of bounded size, never one whole copy;
- ``state()`` / ``load_state(state)``: what a checkpoint holds of it and putting it back;
- ``offload(device)``: its idle state (optimizer, gradients, and weights generation does not
  use) moved while it is idle;
- ``learning_rates()`` / ``set_learning_rates(rates)`` / ``advance_schedule()`` /
  ``scale_lr(scale)``: the one place its learning rates are read and written.

``TrainedModule`` implements it for two layouts: ``OneProcess`` and ``Replicated`` (torchrun
data parallelism: every rank holds the whole module and takes the same optimizer step on
gradients summed over ranks). A sharded layout is a third. Forward passes (logprobs, values)
call ``engine.module`` as the model it is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from honing.rollout.base import BUCKET_BYTES, buckets
from honing.trainer.sharded import local_bytes


class TrainerEngine(Protocol):
    """What the update, checkpointing, weight sync and offload ask of a trained module."""

    role: str  # policy | critic | mtp: the key of its state in a checkpoint
    module: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler | None

    def rows(self, index: torch.Tensor, size: int) -> tuple[torch.Tensor, ...]: ...

    def zero_grad(self) -> None: ...

    def step(self, grad_clip: float) -> tuple[torch.Tensor, bool]: ...

    def reduce(self, totals: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...

    def weights(
        self, pieces: Callable[[nn.Module], Iterable[tuple[str, torch.Tensor]]] | None = None
    ) -> Iterator[list[tuple[str, torch.Tensor]]]: ...

    def state(self, module: bool = True, optimizer: bool = True) -> dict[str, Any]: ...

    def load_state(self, state: dict[str, Any]) -> None: ...

    def offload(self, device: torch.device) -> int: ...

    def learning_rates(self) -> tuple[float, ...]: ...

    def set_learning_rates(self, rates: tuple[float, ...]) -> None: ...

    def advance_schedule(self) -> None: ...

    @property
    def lr_scale(self) -> float: ...

    def scale_lr(self, scale: float) -> None: ...


def clip_and_step(module: nn.Module, optimizer, grad_clip: float) -> tuple[torch.Tensor, bool]:
    """Clips the gradients to ``grad_clip`` (0: off) and steps, unless their norm is not
    finite (a NaN/inf gradient would poison every weight through Adam): then they are
    dropped. Returns the norm and whether the step was taken; one host sync."""
    if grad_clip > 0:
        norm = torch.nn.utils.clip_grad_norm_(module.parameters(), grad_clip)
    else:
        norm = torch.nn.utils.get_total_norm(
            [p.grad for p in module.parameters() if p.grad is not None]
        )
    if isinstance(norm, DTensor):  # the norm over every rank's shards
        norm = norm.full_tensor()
    if not torch.isfinite(norm):
        optimizer.zero_grad(set_to_none=True)
        return norm, False
    optimizer.step()
    return norm, True


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


class OneProcess:
    """The layout of a module held whole by this one process."""

    rank, world = 0, 1
    collective = False  # its passes need no other process

    def prepare(self, module: nn.Module) -> nn.Module:
        return module

    def rows(self, index: torch.Tensor, size: int) -> list[tuple[torch.Tensor, int]]:
        return [(chunk, len(chunk)) for chunk in torch.split(index, size)]

    def reduce_gradients(self, module: nn.Module) -> None:
        return None

    def reduce(self, totals: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return totals

    def gathered(self, pieces):
        return pieces  # whole already

    def load_whole(self, module: nn.Module, pieces) -> list[str]:
        return copy_whole(module, pieces)

    def rowwise(self, compute, batch, width: int) -> torch.Tensor:
        return compute(batch)


class Replicated:
    """The layout of torchrun data parallelism: the whole module on every rank of ``group``;
    rank r runs rows r, r + W, ... of each mini-batch, and the summed gradients (one
    all-reduce per optimizer step) give every rank the single-process step, so every rank
    holds the same weights and optimizer state. Passes without gradients run on one rank
    alone, as in one process."""

    collective = False

    def __init__(self, group):
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)

    def prepare(self, module: nn.Module) -> nn.Module:
        return module

    def gathered(self, pieces):
        return pieces  # whole already

    def load_whole(self, module: nn.Module, pieces) -> list[str]:
        return copy_whole(module, pieces)

    def rowwise(self, compute, batch, width: int) -> torch.Tensor:
        return compute(batch)  # this rank alone

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
        names = sorted(totals)
        values = torch.stack([torch.as_tensor(totals[n], dtype=torch.float64) for n in names])
        dist.all_reduce(values, group=self.group)
        return dict(zip(names, values, strict=True))


class TrainedModule:
    """A ``TrainerEngine``: ``module`` with its optimizer and schedule, laid out by
    ``layout`` (``OneProcess()``, ``Replicated(group)`` or ``sharded.Sharded(group)``, which
    has sharded the module before the optimizer was made). ``serves_generation``: the
    rollout engines sample with the module itself (the policy, the MTP heads), so offloading
    leaves its weights in place."""

    def __init__(
        self,
        role: str,
        module: nn.Module,
        optimizer,
        scheduler=None,
        *,
        layout=None,
        serves_generation: bool = False,
        bucket_bytes: int = BUCKET_BYTES,
        optimizer_offload: bool = False,
    ):
        self.role, self.module = role, module
        self.optimizer, self.scheduler = optimizer, scheduler
        self.layout = layout or OneProcess()
        self.serves_generation = serves_generation
        self.bucket_bytes = bucket_bytes  # the most a bucket of ``weights`` holds
        # memory.optimizer_offload on CUDA: the optimizer's state lives on the host between
        # steps and visits the device for each one
        device = next(module.parameters()).device
        self.optimizer_offload = optimizer_offload and device.type == "cuda"

    def rows(self, index: torch.Tensor, size: int) -> list[tuple[torch.Tensor, int]]:
        return self.layout.rows(index, size)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def step(self, grad_clip: float) -> tuple[torch.Tensor, bool]:
        self.layout.reduce_gradients(self.module)
        if not self.optimizer_offload:
            return clip_and_step(self.module, self.optimizer, grad_clip)
        device = next(self.module.parameters()).device
        move_optimizer_state(self.optimizer, device)
        try:
            return clip_and_step(self.module, self.optimizer, grad_clip)
        finally:
            move_optimizer_state(self.optimizer, torch.device("cpu"))

    def reduce(self, totals: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self.layout.reduce(totals)

    def weights(self, pieces=None) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The module's state in buckets, each tensor whole: its live tensors (the receiver
        copies them), or what ``pieces(module)`` yields (e.g. LoRA adapters merged into
        plain weights); a sharded module's gathered a tensor at a time."""
        source = pieces(self.module) if pieces else self.module.state_dict().items()
        return buckets(self.layout.gathered(source), self.bucket_bytes)

    def state(
        self, module: bool = True, optimizer: bool = True, template: bool = False
    ) -> dict[str, Any]:
        """Its weights (unless not ``module``: the policy's are saved apart, in Hugging Face
        format), its optimizer's state by parameter name (unless not ``optimizer``) and its
        schedule's; a sharded module's hold this rank's shards. An optimizer that has not
        stepped yet (the policy's during the critic's warm-up) has nothing to keep and is left
        out (it starts afresh on resume, as it would have gone on), unless ``template`` (a
        checkpoint is to be read into it): then its state is made (zero moments, the first step
        counted)."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        state = {"module": self.module.state_dict()} if module else {}
        if optimizer and (self.optimizer.state or template):
            state["optimizer"] = get_optimizer_state_dict(self.module, self.optimizer)
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        return state

    def load_state(self, state: dict[str, Any]) -> None:
        """Puts back what ``state`` holds (a checkpoint saved without the optimizer has
        none: Adam's moments then start again). Whole tensors load into a sharded module's
        shards; an optimizer state by parameter index (older checkpoints) loads as it is."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_optimizer_state_dict,
        )

        if "module" in state:
            unknown = self.layout.load_whole(self.module, state["module"].items())
            if unknown:
                raise ValueError(f"the {self.role}'s saved weights do not fit it: {unknown[:3]}")
        saved = state.get("optimizer")
        if saved is not None and all(isinstance(k, int) for k in saved.get("state", {})):
            self.optimizer.load_state_dict(saved)
        elif saved is not None:
            whole = not any(isinstance(v, DTensor) for v in _tensors(saved))
            options = StateDictOptions(full_state_dict=whole and self.layout.collective)
            set_optimizer_state_dict(self.module, self.optimizer, saved, options=options)
        if self.scheduler is not None and "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])
            # LambdaLR does not restore the optimizer's own lr: its last scheduled value.
            self.set_learning_rates(tuple(self.scheduler.get_last_lr()))

    def learning_rates(self) -> tuple[float, ...]:
        """The learning rate of each parameter group, as the next optimizer step uses it."""
        return tuple(group["lr"] for group in self.optimizer.param_groups)

    def set_learning_rates(self, rates: tuple[float, ...]) -> None:
        """Sets each parameter group's learning rate (a torchrun rank takes rank 0's)."""
        for group, lr in zip(self.optimizer.param_groups, rates, strict=True):
            group["lr"] = lr

    def advance_schedule(self) -> None:
        """The learning-rate schedule's next step (none without a schedule)."""
        if self.scheduler is not None:
            self.scheduler.step()

    @property
    def lr_scale(self) -> float:
        """The factor on its schedule's rates (1 until ``scale_lr``)."""
        return getattr(self.scheduler, "scale", 1.0)

    def scale_lr(self, scale: float) -> None:
        """From now on its learning rates are the schedule's times ``scale`` (an alert
        rollback's ``lr_scale``, accumulated by the caller); checkpoints keep it with the
        schedule.

        Raises:
            ValueError: the module has no scaled schedule (``optim.ScaledSchedule``).
        """
        if not hasattr(self.scheduler, "rescale"):
            raise ValueError(f"the {self.role}'s learning rate has no schedule to scale")
        self.scheduler.rescale(scale)

    def offload(self, device: torch.device) -> int:
        """Its idle state to ``device``: the optimizer's, and the module's own weights unless
        generation samples with them (``serves_generation``); on the way to the host its
        gradients are dropped (the next update zeroes them before use). Returns the bytes
        moved."""
        moved = move_optimizer_state(self.optimizer, device)
        if device.type == "cpu":
            for param in self.module.parameters():
                if param.grad is not None:
                    moved += param.grad.numel() * param.grad.element_size()
                    param.grad = None
        if not self.serves_generation:
            moved += sum(p.numel() * p.element_size() for p in self.module.parameters())
            self.module.to(device)
        return moved

    def state_bytes(self) -> int:
        """Bytes of parameters, gradients and optimizer state this process holds (a shard of
        each, when sharded): what the strategy saves (``memory/model_state_mb``)."""
        params = list(self.module.parameters())
        grads = [p.grad for p in params if p.grad is not None]
        moments = [
            value
            for state in self.optimizer.state.values()
            for value in state.values()
            if torch.is_tensor(value) and value.dim() > 0
        ]
        return local_bytes(params) + local_bytes(grads) + local_bytes(moments)


def _tensors(tree) -> Iterator[torch.Tensor]:
    if isinstance(tree, dict):
        for value in tree.values():
            yield from _tensors(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from _tensors(value)
    elif torch.is_tensor(tree):
        yield tree
