"""Trainer engines: one per trained module (the policy, the critic, the MTP heads).

An engine owns its module, optimizer and learning-rate schedule, and is the only thing that
knows how the module is laid out across processes (its ``layouts.Layout``: whole in this
process, replicated on every torchrun rank, or sharded over them). Everything else asks it
for what depends on that layout:

- the update: ``rows(index, size, tokens, budget)`` (this process's micro-batches of a
  mini-batch's rows, by count or by a token budget with the rows dealt to the ranks by their
  tokens), ``step(grad_clip)`` (gradients reduced across processes, clipped, the optimizer
  step, skipped when their norm is not finite), ``reduce(totals, how)`` (metric sums, or
  maxima, over processes);
- passes without gradient: ``forward_rows(compute, batch, width)`` (a pass over the batch's
  rows as the layout runs it, every rank's rows gathered when sharded or sequence-parallel)
  and ``lay_out_alike(module)`` (a frozen module, the reference, laid out the same way);
- ``response_logprobs(model, batch, **options)``: the logprob pass of this module (or its
  reference) as the layout runs it (with sequence parallelism, each row shared by the ranks
  of a slot, the whole [B, R] on each);
- weights: ``weights(...)`` for the rollout engines, as buckets of (name, tensor) pieces of
  bounded size, never one whole copy; ``whole_tensors(...)`` one at a time (a checkpoint's
  Hugging Face files); ``load_tensors(pieces)``; ``generation_module``, what an in-process
  rollout engine samples with (the module itself, or a whole copy when it is sharded);
- checkpoints: ``state()`` / ``load_state(state)``, and ``save_shards`` / ``load_shards``
  (the sharded part: torch.distributed.checkpoint over the engine's ranks);
- ``offload(device)``: its idle state (optimizer, gradients, and weights generation does not
  use) moved while it is idle; ``state_bytes()``;
- ``learning_rates()`` / ``set_learning_rates(rates)`` / ``advance_schedule()`` /
  ``scale_lr(scale)``: the one place its learning rates are read and written;
- ``is_sharded`` (each rank holds a shard), ``passes_together`` (every pass without
  gradient runs on every rank together: sharded, or sequence-parallel), ``world_size`` and
  ``data_parallel_size`` (the slots the rows are dealt to: ranks / (sequence_parallel x
  tensor_parallel)).

``TrainedModule`` implements it for every layout; ``TrainedModule.laid_out`` lays a module
out before its optimizer is made, as sharding requires.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from honing.models.loading import is_lora
from honing.rollout.base import WeightBucket
from honing.trainer.expert_parallel import ExpertShards
from honing.trainer.layouts import Layout, OneProcess, Replicated
from honing.trainer.optimizer_step import clip_and_step, move_optimizer_state
from honing.trainer.sharded import Sharded, local_bytes

# What a module is read as, for ``weights`` / ``whole_tensors``: its state, or other pieces
# made from it (a LoRA policy's adapters merged into plain weights).
Pieces = Callable[[nn.Module], Iterable[tuple[str, torch.Tensor]]]
BUCKET_BYTES = 256 << 20  # rollout.weight_bucket_mb's default


class TrainerEngine(Protocol):
    """What the update, experience, checkpoints, weight sync and offload ask of a trained
    module (the module docstring lists the groups)."""

    role: str  # policy | critic | mtp: the key of its state in a checkpoint
    module: nn.Module  # forward passes call it as the model it is
    generation_module: nn.Module  # what an in-process rollout engine samples with
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler | None

    @property
    def is_sharded(self) -> bool: ...

    @property
    def world_size(self) -> int: ...

    @property
    def passes_together(self) -> bool: ...

    @property
    def data_parallel_size(self) -> int: ...

    def response_logprobs(self, model: nn.Module, batch, **options) -> tuple: ...

    def values(self, batch) -> torch.Tensor: ...

    def rows(
        self, index: torch.Tensor, size: int, tokens: torch.Tensor | None = None, budget: int = 0
    ) -> list[tuple[torch.Tensor, int]]: ...

    def zero_grad(self) -> None: ...

    def step(self, grad_clip: float) -> tuple[torch.Tensor, bool]: ...

    def reduce(
        self, totals: dict[str, torch.Tensor], how: str = "sum"
    ) -> dict[str, torch.Tensor]: ...

    def forward_rows(self, compute: Callable, batch, width: int) -> torch.Tensor: ...

    def lay_out_alike(self, module: nn.Module) -> nn.Module: ...

    def whole_tensors(self, pieces: Pieces | None = None) -> Iterator[tuple[str, torch.Tensor]]: ...

    def weights(self, pieces: Pieces | None = None) -> Iterator[list[tuple[str, torch.Tensor]]]: ...

    def load_tensors(self, pieces: Iterable[tuple[str, torch.Tensor]]) -> list[str]: ...

    def state(
        self, module: bool = True, optimizer: bool = True, template: bool = False
    ) -> dict[str, Any]: ...

    def load_state(self, state: dict[str, Any]) -> None: ...

    def save_shards(self, states: dict[str, Any], directory: Path) -> None: ...

    def load_shards(self, template: dict[str, Any], directory: Path) -> None: ...

    def offload(self, device: torch.device) -> int: ...

    def state_bytes(self) -> int: ...

    def expert_metrics(self) -> dict[str, float]: ...

    def learning_rates(self) -> tuple[float, ...]: ...

    def set_learning_rates(self, rates: tuple[float, ...]) -> None: ...

    def advance_schedule(self) -> None: ...

    @property
    def lr_scale(self) -> float: ...

    def scale_lr(self, scale: float) -> None: ...


def make_layout(
    strategy: str,
    group,
    *,
    reshard_after_forward: bool = True,
    param_dtype: str = "float32",
    param_offload: bool = False,
    sequence: int = 1,
    tensor: int = 1,
    expert: int = 1,
) -> Layout:
    """The layout of ``trainer.strategy`` (``replicate`` | ``fsdp``) over the torchrun
    ``group``, ``sequence`` ranks sharing each sequence (``trainer.sequence_parallel``),
    ``tensor`` ranks splitting each weight (``trainer.tensor_parallel``), ``expert`` slots
    sharing the routed experts (``trainer.expert_parallel``); whole in this process when
    there is no group."""
    if group is None:
        return OneProcess()
    if strategy == "fsdp":
        return Sharded(
            group,
            reshard_after_forward=reshard_after_forward,
            param_dtype=param_dtype,
            param_offload=param_offload,
            sequence=sequence,
            tensor=tensor,
            expert=expert,
        )
    return Replicated(group, sequence, tensor, expert)


class TrainedModule:
    """A ``TrainerEngine``: ``module`` (already laid out by ``layout``) with its optimizer
    and schedule. ``serves_generation``: the rollout engines sample with the module itself
    (the policy, the MTP heads), so offloading leaves its weights in place."""

    def __init__(
        self,
        role: str,
        module: nn.Module,
        optimizer,
        scheduler=None,
        *,
        layout: Layout | None = None,
        serves_generation: bool = False,
        bucket_bytes: int = BUCKET_BYTES,
        optimizer_offload: bool = False,
    ):
        self.role, self.module = role, module
        self.generation_module = module
        self.optimizer, self.scheduler = optimizer, scheduler
        self.layout = layout or OneProcess()
        self.serves_generation = serves_generation
        self.bucket_bytes = bucket_bytes  # the most a bucket of ``weights`` holds
        # memory.optimizer_offload on CUDA: the optimizer's state lives on the host between
        # steps and visits the device for each one
        device = next(module.parameters()).device
        self.optimizer_offload = optimizer_offload and device.type == "cuda"

    @classmethod
    def laid_out(
        cls,
        role: str,
        module: nn.Module,
        layout: Layout,
        make_optimizer: Callable[[nn.Module], tuple[Any, Any]],
        **options,
    ) -> TrainedModule:
        """``module`` laid out by ``layout`` (sharded in place when it shards), then the
        optimizer and schedule ``make_optimizer(module)`` makes for it. An engine that
        ``serves_generation`` under a sharded layout keeps a whole copy, made first, for
        in-process sampling (``generation_module``; it takes the weights after each update,
        gathered a tensor at a time)."""
        whole = None
        if options.get("serves_generation") and layout.collective:
            whole = copy.deepcopy(module).eval().requires_grad_(False)
        module = layout.prepare(module)
        engine = cls(role, module, *make_optimizer(module), layout=layout, **options)
        if whole is not None:
            engine.generation_module = whole
        return engine

    @property
    def is_sharded(self) -> bool:
        """Whether every pass of the module runs on every rank together, each with a shard."""
        return self.layout.collective

    @property
    def world_size(self) -> int:
        """The number of processes sharing the module."""
        return self.layout.world

    @property
    def passes_together(self) -> bool:
        """Whether every pass without gradient runs on every rank together (sharded, or
        sequences shared by several ranks): the other ranks must join each one."""
        return self.layout.passes_together

    @property
    def data_parallel_size(self) -> int:
        """The number of row shares a mini-batch is dealt into (ranks / (sequence_parallel x
        tensor_parallel))."""
        return self.layout.slots

    def response_logprobs(self, model: nn.Module, batch, **options) -> tuple:
        """``batch.response_logprobs(model, batch, **options)`` as this module's passes run
        (``model``: the module, or its reference laid out alike)."""
        return self.layout.logprobs(model, batch, **options)

    def values(self, batch) -> torch.Tensor:
        """The module's (a critic's) values of ``batch``'s response tokens, [B, R], as its
        passes run (under SP each row shared by the slot's ranks, the whole [B, R] on each)."""
        return self.layout.values(self.module, batch)

    def rows(
        self, index: torch.Tensor, size: int, tokens: torch.Tensor | None = None, budget: int = 0
    ) -> list[tuple[torch.Tensor, int]]:
        return self.layout.rows(index, size, tokens, budget)

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

    def reduce(self, totals: dict[str, torch.Tensor], how: str = "sum") -> dict[str, torch.Tensor]:
        return self.layout.reduce(totals, how)

    def forward_rows(self, compute: Callable, batch, width: int) -> torch.Tensor:
        """``compute(rows)`` ([rows, <= width], no gradient) over ``batch`` as this module's
        passes run: on the whole batch here, or each rank on its rows when sharded (every
        rank takes part), gathered into the batch's [B, width] on every rank."""
        return self.layout.rowwise(compute, batch, width)

    def lay_out_alike(self, module: nn.Module) -> nn.Module:
        """A frozen module (the reference) laid out as this one, so that its passes run
        alongside this one's (``forward_rows``)."""
        return self.layout.prepare(module)

    def whole_tensors(self, pieces: Pieces | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """The module's tensors, each whole, one at a time (a sharded module's gathered as
        its turn comes, every rank taking part): its state, or what ``pieces(module)``
        yields."""
        source = pieces(self.module) if pieces else self.module.state_dict().items()
        return self.layout.gathered(source)

    def weights(self, pieces: Pieces | None = None) -> Iterator[WeightBucket]:
        """``whole_tensors`` in buckets of at most ``bucket_bytes``, for the rollout engines
        (they copy the live tensors they get), each made when it is asked for."""
        whole = _untied(self.whole_tensors(pieces), tied_names(self.module))
        return buckets(whole, self.bucket_bytes)

    def load_tensors(self, pieces: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """Copies whole tensors into the module by name (this rank's shards of them when
        sharded); returns the names it does not have."""
        return self.layout.load_whole(self.module, pieces)

    def save_shards(self, states: dict[str, Any], directory: Path) -> None:
        """``states`` (this rank's shards) into ``directory``, every rank of the layout
        writing its own (torch.distributed.checkpoint)."""
        import torch.distributed.checkpoint as dcp

        dcp.save(states, checkpoint_id=str(directory), process_group=self.layout.group)

    def load_shards(self, template: dict[str, Any], directory: Path) -> None:
        """Fills ``template`` (``state(template=True)``'s shape) from the shards in
        ``directory``, written at any world size; in one process too."""
        import torch.distributed.checkpoint as dcp

        if self.is_sharded:
            dcp.load(template, checkpoint_id=str(directory), process_group=self.layout.group)
        else:
            dcp.load(template, checkpoint_id=str(directory), no_dist=True)

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
        shards."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_optimizer_state_dict,
        )

        if "module" in state:
            unknown = self.load_tensors(state["module"].items())
            if unknown:
                raise ValueError(f"the {self.role}'s saved weights do not fit it: {unknown[:3]}")
        saved = state.get("optimizer")
        if saved is not None:
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
        return self._held_bytes(list(self.module.parameters()))

    def _held_bytes(self, params: list[nn.Parameter]) -> int:
        """Bytes this process holds of ``params``, their gradients and their optimizer state."""
        grads = [p.grad for p in params if p.grad is not None]
        moments = [
            value
            for p in params
            for value in self.optimizer.state.get(p, {}).values()
            if torch.is_tensor(value) and value.dim() > 0
        ]
        return local_bytes(params) + local_bytes(grads) + local_bytes(moments)

    def expert_metrics(self) -> dict[str, float]:
        """Under expert parallelism (none without): ``memory/expert_state_mb``, the routed
        experts' parameters, gradients and optimizer state this process holds, and the
        dispatch's ``ep/load_imbalance/max`` and ``/mean`` since the last call
        (``ExpertShards.take_metrics``)."""
        shards = ExpertShards.of(self.module)
        if shards is None:
            return {}
        held = self._held_bytes(shards.parameters())
        return {"memory/expert_state_mb": held / 2**20} | shards.take_metrics()


def buckets(
    pieces: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[WeightBucket]:
    """``pieces`` grouped into lists of at most ``bucket_bytes`` (a larger tensor alone), each
    list handed over before the pieces of the next are read."""
    bucket, size = [], 0
    for name, tensor in pieces:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def _tensors(tree) -> Iterator[torch.Tensor]:
    if isinstance(tree, dict):
        for value in tree.values():
            yield from _tensors(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from _tensors(value)
    elif torch.is_tensor(tree):
        yield tree


def tied_names(module: nn.Module) -> frozenset[str]:
    """The names under which ``module`` (or a LoRA model's base, as its plain weights are
    named) holds a parameter it holds under an earlier name: an output head tied to the
    embeddings."""
    modules = [module] + ([module.get_base_model()] if is_lora(module) else [])
    names = set()
    for each in modules:
        first = set()
        for name, param in each.named_parameters(remove_duplicate=False):
            if id(param) in first:
                names.add(name)
            first.add(id(param))
    return frozenset(names)


def _untied(pieces, tied: frozenset[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """``pieces`` without the ``tied`` names: every engine ties them again from its model's
    config, so a tied tensor is sent once."""
    return ((name, tensor) for name, tensor in pieces if name not in tied)
