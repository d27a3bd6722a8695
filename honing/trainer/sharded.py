"""The sharded layout of a trained module (``trainer.strategy=fsdp``): PyTorch's FSDP2.

Every decoder layer is a ``fully_shard`` unit, then the whole model: each rank of the torchrun
group holds 1/N of every parameter, of its gradient and of the optimizer's state for it, and
gathers a unit's whole parameters only while that unit runs. Gradients are summed across
ranks (not averaged: each rank's loss is already normalised by the whole mini-batch, as under
``Replicated``), in the backward pass itself.

Because every forward pass gathers parameters from every rank, all ranks run every pass of a
sharded module together, each on its own rows: micro-batches come in the same number on every
rank (a rank short of rows runs a masked copy of one), no-gradient passes gather their rows'
results to every rank (``rowwise``), and the weights for the rollout engines are gathered one
tensor at a time (``gathered``), every rank taking part.

Mixed precision (``trainer.fsdp_param_dtype``): parameters are cast for compute, gradients
reduced in float32. ``memory.param_offload``: parameters, gradients and the optimizer step on
the host (FSDP2's CPU offload; CUDA only, a no-op on the CPU).

With sequence parallelism the shards still span every rank: the ranks of a slot run the same
rows, each its share of every sequence, and FSDP's reduce-scatter (a sum, as above) adds the
parts of every rank of every slot, the one-process gradient. A shared logprob pass calls the
decoder and the head directly, not the model's ``forward``, so it runs inside the root's
gather and post-backward hooks through ``run_in_forward``, registered as an FSDP forward
method.

With tensor parallelism (``trainer.tensor_parallel=N``) the module is split over each slot's
N ranks first (``trainer/tensor_parallel.py``), then sharded over the slots (the mesh's
``dp`` dimension): 2-D, torchtitan's order. A split weight is then a DTensor over both
dimensions, a whole one (embeddings, norms) over ``dp``; the reduce-scatter sums the slots.

With expert parallelism (``trainer.expert_parallel=N``) the routed experts are split over the
mesh's ``ep`` dimension first (``trainer/expert_parallel.py``) and FSDP leaves them out
(``ignored_params``): each rank holds E / N experts whole, and their gradients are summed
over the ranks holding the same ones (``edp``) after the backward passes. Everything else is
sharded over every slot as without experts.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from honing.errors import ConfigError
from honing.trainer.layouts import (
    Layout,
    even_rows,
    expert_parameters,
    mesh_slots,
    reduce_across,
    reduce_experts,
    rowwise_by_slots,
    with_experts,
    with_ulysses,
)
from honing.trainer.tensor_parallel import parallelize
from honing.trainer.ulysses.packed import shared_logprobs

DTYPES = {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}


def decoder_layers(module: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a causal LM: the first ``layers`` list among its submodules
    (``model.layers`` in Hugging Face's families; under a LoRA or value-model wrapper too);
    ``ConfigError`` naming the class when there is none."""
    for name, child in module.named_modules():
        if name.rsplit(".", 1)[-1] == "layers" and isinstance(child, nn.ModuleList) and len(child):
            return list(child)
    raise ConfigError(
        f"trainer.strategy=fsdp: {type(module).__name__} has no list of decoder layers "
        "(a 'layers' ModuleList) to shard; use trainer.strategy=replicate for this model"
    )


class Sharded(Layout):
    """The layout of FSDP2 over the torchrun ``group`` (see the module)."""

    collective = True  # every pass of the module is run by every rank together

    def __init__(
        self,
        group,
        *,
        reshard_after_forward: bool = True,
        param_dtype: str = "float32",
        param_offload: bool = False,
        sequence: int = 1,
        tensor: int = 1,
        expert: int = 1,
    ):
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        mesh_slots(self, sequence, tensor, expert)
        self.reshard_after_forward = reshard_after_forward
        self.param_dtype = DTYPES[param_dtype]
        self.param_offload = param_offload

    def prepare(self, module: nn.Module) -> nn.Module:
        """Shards ``module`` in place (each decoder layer, then the whole; over the slots
        after the tensor-parallel split, the experts left to expert parallelism); returns
        it."""
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import (
            CPUOffloadPolicy,
            FSDPModule,
            MixedPrecisionPolicy,
            fully_shard,
            register_fsdp_forward_method,
        )

        module = parallelize(with_ulysses(module, self.sp.world), self.tp)
        module = with_experts(module, self.ep)

        device = next(module.parameters()).device
        if self.tp is None:
            mesh = DeviceMesh.from_group(self.group, device.type)
        else:
            mesh = self.mesh["dp"]
        options = {
            "mesh": mesh,
            "reshard_after_forward": self.reshard_after_forward,
            "mp_policy": MixedPrecisionPolicy(
                param_dtype=self.param_dtype, reduce_dtype=torch.float32
            ),
        }
        if self.param_offload and device.type == "cuda":
            options["offload_policy"] = CPUOffloadPolicy()
        if experts := set(expert_parameters(module)):
            options["ignored_params"] = experts
        try:
            for layer in decoder_layers(module):
                fully_shard(layer, **options)
            fully_shard(module, **options)
        except ConfigError:
            raise
        except (RuntimeError, ValueError, AssertionError) as err:
            raise ConfigError(
                f"trainer.strategy=fsdp cannot shard {type(module).__name__}: {err}; use "
                "trainer.strategy=replicate for this model"
            ) from None
        for unit in module.modules():  # each unit reduces its own gradients
            if isinstance(unit, FSDPModule):
                unit.set_gradient_divide_factor(1.0)  # summed, not averaged (see the module)
                unit.set_force_sum_reduction_for_comms(True)  # a plain sum: gloo has no PREMUL_SUM
        module.run_in_forward = types.MethodType(run_in_forward, module)
        register_fsdp_forward_method(module, "run_in_forward")
        return module

    def rows(
        self, index: torch.Tensor, size: int, tokens: torch.Tensor | None = None, budget: int = 0
    ) -> list[tuple[torch.Tensor, int]]:
        return even_rows(self, index, size, tokens, budget)

    def reduce_gradients(self, module: nn.Module) -> None:
        """FSDP reduced the gradients in the backward pass; the experts' (left out of it)
        are summed over ``edp``."""
        reduce_experts(module, self.edp)

    def reduce(self, totals: dict[str, torch.Tensor], how: str = "sum") -> dict[str, torch.Tensor]:
        return reduce_across(totals, self.dp, how)

    def logprobs(self, model: nn.Module, batch, **options) -> tuple:
        if self.sp.world == 1:
            return super().logprobs(model, batch, **options)

        def compute():  # copies, not views, out of an FSDP forward (its hooks hold them)
            return tuple(
                None if t is None else t.clone()
                for t in shared_logprobs(model, batch, self.sp, **options)
            )

        return model.run_in_forward(compute)

    def rowwise(self, compute: Callable, batch, width: int) -> torch.Tensor:
        """``compute(rows)`` of this rank's rows, every rank's results gathered into the
        whole batch's [B, width] tensor on every rank."""
        return rowwise_by_slots(self, compute, batch, width)


def run_in_forward(module: nn.Module, compute: Callable):
    """``compute()``, as an FSDP forward method of ``module`` (``prepare`` registers it): its
    root's parameters gathered around it, its outputs' backward reducing their gradients."""
    return compute()


def local_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of this rank's part of each tensor (a shard's, for a sharded one)."""
    total = 0
    for tensor in tensors:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        total += local.numel() * local.element_size()
    return total
