"""Expert parallelism: a mixture-of-experts model's routed experts sharded over the ranks of
an ``ep`` group, each rank holding E / ep of them, as torchtitan's ``ExpertParallel`` does.

Each rank runs the whole model on its own tokens. The routers stay as they are and route the
rank's tokens, so honing's ``RoutingSession`` hooks (record, replay, statistics, router
losses) see what they see in one process, and a replayed plan is what is dispatched. Only the
experts module of each MoE block changes (``ExpertParallelExperts``): it sends every
(token, chosen expert) pair to the rank holding that expert, computes its experts on what it
receives, and sends the outputs back, where they are weighted by the router and summed over
the top-k as the family's own experts module sums them:

1. the pairs sorted by expert (experts are held in contiguous blocks, so also by rank), and
   the count per expert gathered from every rank (one small all-gather: every rank learns
   what each receives, hence the load-imbalance metric without another collective);
2. the tokens dispatched with ``all_to_all_single`` (uneven splits; its autograd sends the
   gradients back the same way);
3. the received rows grouped by local expert, run by ``grouped_mm`` where the device and
   dtype allow, else a loop over the experts, then put back in arrival order;
4. the outputs combined back by the reverse ``all_to_all_single`` and unsorted.

What it takes: transformers' fused experts (a class under ``use_experts_implementation``:
``gate_up_proj`` or ``up_proj`` and ``down_proj`` of [E, ...], optional biases of [E, ...],
its own gate); every other experts layout is refused in one line. Shared experts are dense
and stay replicated.

Each rank's experts are parameters of DTensor type, ``Shard(0)`` on the 1-D ``ep`` mesh, so
what handles a split tensor handles them: gathered whole for weight sync and exports
(``full_tensor``), loaded from whole tensors as this rank's slice, saved and read by
``torch.distributed.checkpoint`` under any other layout, and normed over the ranks before
clipping. What the trainer's layout must still do: leave the expert gradients unreduced over
``ep`` (each rank holds other experts, and their gradients already sum every rank's tokens),
reduce them over the ranks that hold the same experts (``edp``), and run every pass on every
rank of the group, as many and in the same order: a pass is a collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import mean

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from honing.errors import ConfigError
from honing.models.moe import Routers, routers_of

# the fused layouts' parameter names, each of [E, ...]
PROJECTIONS = ("gate_up_proj", "up_proj", "down_proj")
BIASES = tuple(f"{name}_bias" for name in PROJECTIONS)
GROUPED_MM_CPU = (torch.float32, torch.bfloat16, torch.float16)  # checked on torch 2.13


def route(experts: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The dispatch order of the [S] pairs' ``experts``: ``order`` [S], the pairs sorted by
    expert (stable; a slot outside 0 .. E-1, a null or padding slot, last and never sent),
    and ``counts`` [E] the pairs per expert."""
    valid = (experts >= 0) & (experts < num_experts)
    slots = torch.where(valid, experts, num_experts)
    order = torch.argsort(slots, stable=True)
    counts = torch.bincount(slots, minlength=num_experts + 1)[:num_experts]
    return order, counts


def local_order(received: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """How the rows a rank receives are regrouped by its local experts.

    Args:
        received: [ep, El] how many rows each source rank sends to each local expert; rows
            arrive by source rank, each source's rows sorted by expert.

    Returns:
        ``regroup`` [R]: the arrival row of each row in expert-major order (stable: by
        source within an expert), and ``sizes`` [El]: the rows per local expert."""
    ep, local = received.shape
    expert = torch.arange(local, device=received.device).repeat(ep)  # [ep * El]
    arrival = torch.repeat_interleave(expert, received.reshape(-1))  # [R]: local expert
    return torch.argsort(arrival, stable=True), received.sum(0)


def inverse(permutation: torch.Tensor) -> torch.Tensor:
    """``q`` with ``q[permutation[i]] = i``."""
    out = torch.empty_like(permutation)
    out[permutation] = torch.arange(permutation.numel(), device=permutation.device)
    return out


def _exchange(rows: torch.Tensor, out_splits: list[int], in_splits: list[int], group):
    """``rows`` split by ``in_splits`` to the ranks of ``group``; what they send back, by
    ``out_splits`` (differentiable: the backward exchanges the gradients the other way)."""
    received = funcol.all_to_all_single(rows.contiguous(), out_splits, in_splits, group)
    return funcol.wait_tensor(received)


def _gather(tensor: torch.Tensor, group) -> torch.Tensor:
    """``tensor`` of every rank of ``group``, concatenated on dim 0 in rank order."""
    gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor  # torch<2.13
    return funcol.wait_tensor(gather(tensor.contiguous(), 0, group))


class _ContiguousGrad(torch.autograd.Function):
    """The identity, whose backward hands on a contiguous gradient (``grouped_mm``'s backward
    refuses strides that are not multiples of 16 bytes)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def grouped_mm_fits(weight: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether ``grouped_mm`` runs the experts of ``weight`` [El, a, b] in ``dtype``: on CPU in
    float32, bfloat16 and float16; on CUDA in bfloat16 from compute capability 8.0; every row
    a multiple of 16 bytes."""
    if not hasattr(torch.nn.functional, "grouped_mm") and not hasattr(torch, "_grouped_mm"):
        return False
    size = torch.empty((), dtype=dtype).element_size()
    if any(dim * size % 16 for dim in weight.shape[1:]):
        return False
    if weight.device.type == "cpu":
        return dtype in GROUPED_MM_CPU
    if weight.device.type == "cuda":
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(weight.device) >= (8, 0)
    return False


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor`` (a DTensor's local shard, differentiably)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    run = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm
    return _ContiguousGrad.apply(run(x, weight, offs=offsets))


class ExpertParallelExperts(nn.Module):
    """The experts of one MoE block, ``size`` ranks sharing them: this rank holds experts
    ``first`` .. ``first + local - 1`` under the parameter names of the module it replaces,
    and its forward takes the same ``(hidden_states, top_k_index, top_k_weights)`` over the
    rank's own tokens. ``num_experts`` stays the whole count, as the routers see it.

    ``counts`` [ep, E] sums, over the calls since ``take_counts``, the pairs each rank sent
    to each expert (the same on every rank)."""

    def __init__(self, source: nn.Module, mesh: DeviceMesh, num_experts: int):
        super().__init__()
        for key, value in vars(source).items():  # what the family's gate reads
            if not key.startswith("_") and key != "training":
                setattr(self, key, value)
        self.group, self.num_experts = mesh.get_group(), num_experts
        self.size, self.rank = mesh.size(), mesh.get_local_rank()
        self.local = num_experts // self.size
        self.first = self.rank * self.local
        for name, child in source.named_children():  # the activation
            self.add_module(name, child)
        for name, param in source.named_parameters(recurse=False):
            shard = param.detach()[self.first : self.first + self.local].clone()
            split = DTensor.from_local(shard, mesh, [Shard(0)], run_check=False)
            self.register_parameter(name, nn.Parameter(split, requires_grad=param.requires_grad))
        self._gate = type(source)._apply_gate if self.has_gate else None
        self.counts = torch.zeros(self.size, num_experts, dtype=torch.long)

    def take_counts(self) -> torch.Tensor:
        counts, self.counts = self.counts, torch.zeros_like(self.counts)
        return counts

    def forward(self, hidden_states, top_k_index, top_k_weights):
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])  # [N, H]
        top_k = top_k_index.shape[-1]
        order, counts = route(top_k_index.reshape(-1), self.num_experts)  # [S], [E]
        # every rank's counts, on the host: the call's one sync, for the splits
        matrix = _gather(counts, self.group).view(self.size, self.num_experts).cpu()  # [ep, E]
        self.counts += matrix
        received = matrix[:, self.first : self.first + self.local]  # [ep, El]
        send = matrix[self.rank].view(self.size, self.local).sum(1).tolist()  # rows per rank
        receive = received.sum(1).tolist()
        sent = order[: sum(send)]  # the pairs that go to an expert, sorted by it
        arrived = _exchange(x[sent // top_k], receive, send, self.group)  # [R, H]
        regroup, sizes = local_order(received)
        regroup = regroup.to(x.device)
        out = self._experts(arrived[regroup], sizes.tolist())[inverse(regroup)]  # [R, H]
        back = _exchange(out, send, receive, self.group)  # [sum(send), H]
        dropped = back.new_zeros(order.numel() - back.shape[0], back.shape[-1])
        pairs = torch.cat([back, dropped])[inverse(order)]  # [S, H] in the pairs' order
        weighted = pairs * top_k_weights.reshape(-1, 1)
        return weighted.view(-1, top_k, pairs.shape[-1]).sum(1).to(x.dtype).view(shape)

    def _experts(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """[R, H] rows grouped by local expert (``sizes`` of them each) through their expert."""
        counts = torch.tensor(sizes, device=x.device)
        up = "gate_up_proj" if self.has_gate else "up_proj"
        with torch.autocast(x.device.type, enabled=False):  # grouped_mm has no autocast
            h = self._project(x, up, sizes, counts)
            h = self._gate(self, h) if self._gate is not None else self.act_fn(h)
            return self._project(h, "down_proj", sizes, counts)

    def _project(self, x, name: str, sizes: list[int], counts: torch.Tensor) -> torch.Tensor:
        """One of the experts' linear maps on rows grouped by expert (``counts`` [El] on the
        device, ``sizes`` on the host), in the weight's dtype (under autocast too, as
        transformers' ``grouped_mm`` experts implementation computes them)."""
        weight = local(getattr(self, name))  # [El, out, in], or [El, in, out] when transposed
        dtype = weight.dtype
        x = x.to(dtype)
        by_row = weight if self.is_transposed else weight.transpose(-2, -1)  # [El, in, out]
        if grouped_mm_fits(weight, dtype):
            out = _grouped_mm(x, by_row, counts.cumsum(0).to(torch.int32))
        else:
            parts = [part @ by_row[e] for e, part in enumerate(x.split(sizes)) if sizes[e]]
            out = torch.cat(parts) if parts else x.new_zeros(0, by_row.shape[-1])
        bias = getattr(self, f"{name}_bias", None)
        if bias is not None:
            expert = torch.repeat_interleave(torch.arange(len(sizes), device=x.device), counts)
            out = out + local(bias)[expert]
        return out


@dataclass
class ExpertShards:
    """Where a model's experts are after ``apply_expert_parallel``, for the trainer.

    Attributes:
        size, rank: the ``ep`` group's size and this rank's place in it.
        modules: each MoE block's experts, by its name in the model.
    """

    size: int
    rank: int
    modules: dict[str, ExpertParallelExperts]

    @classmethod
    def of(cls, model: nn.Module) -> ExpertShards | None:
        """The expert-parallel experts of ``model`` (None when it has none)."""
        modules = {n: m for n, m in model.named_modules() if isinstance(m, ExpertParallelExperts)}
        if not modules:
            return None
        first = next(iter(modules.values()))
        return cls(first.size, first.rank, modules)

    @property
    def parameter_names(self) -> tuple[str, ...]:
        """The expert parameters' names in the model: their gradients are not reduced over
        ``ep`` (each rank holds other experts); every other parameter's are, as usual."""
        return tuple(
            f"{path}.{name}"
            for path, module in self.modules.items()
            for name, _ in module.named_parameters(recurse=False)
        )

    def parameters(self) -> list[nn.Parameter]:
        return [p for m in self.modules.values() for p in m.parameters(recurse=False)]

    def expert_bytes(self) -> int:
        """The bytes of expert parameters this rank holds."""
        return sum(local(p).nbytes for p in self.parameters())

    def take_metrics(self) -> dict[str, float]:
        """Since the last take, over the MoE layers: ``ep/load_imbalance/max`` and ``/mean``,
        the most pairs a rank's experts received over the mean over ranks (1: even)."""
        ratios = []
        for module in self.modules.values():
            counts = module.take_counts()  # [ep, E]
            received = counts.view(self.size, self.size, -1).sum((0, 2)).double()  # [ep]
            if received.sum() > 0:
                ratios.append(float(received.max() / received.mean()))
        if not ratios:
            return {}
        return {"ep/load_imbalance/max": max(ratios), "ep/load_imbalance/mean": mean(ratios)}


def _check_layout(experts: nn.Module, family: str, num_experts: int) -> None:
    """Raises ConfigError unless ``experts`` is a fused experts module this file shards."""
    params = dict(experts.named_parameters(recurse=False))
    up = "gate_up_proj" if getattr(experts, "has_gate", True) else "up_proj"
    fused = (
        hasattr(experts, "has_gate")  # transformers' use_experts_implementation
        and {up, "down_proj"} <= params.keys() <= {*PROJECTIONS, *BIASES}
        and all(p.shape[0] == num_experts for p in params.values())
        and not list(experts.buffers())
        and not any(True for child in experts.children() for _ in child.parameters())
    )
    if not fused:
        raise ConfigError(
            f"trainer.expert_parallel: the {family} family's experts ({type(experts).__name__}) "
            "are not transformers' fused experts of [experts, ...] weights that it shards"
        )


def check_expert_parallel(model: nn.Module, size: int) -> Routers:
    """The routers of ``model`` if its experts can be sharded over ``size`` ranks (a check
    that needs no process group: at the start of a run).

    Raises:
        ConfigError: the model has no routed MoE layers honing reads, its experts are another
            layout, or its experts do not divide among the ranks.
    """
    routers = routers_of(model)
    if routers is None:
        family = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        raise ConfigError(
            f"trainer.expert_parallel: the {family} model has no top-k routed "
            "mixture-of-experts layers that honing reads"
        )
    for block in routers.blocks:
        if isinstance(block.experts, ExpertParallelExperts):
            raise ValueError("the model's experts are already expert-parallel")
        _check_layout(block.experts, routers.family, routers.num_experts)
    if routers.num_experts % size:
        raise ConfigError(
            f"trainer.expert_parallel={size}: the {routers.family} model's "
            f"{routers.num_experts} experts do not divide among {size} ranks"
        )
    return routers


def apply_expert_parallel(model: nn.Module, ep: DeviceMesh | dist.ProcessGroup) -> ExpertShards:
    """Shard the routed experts of ``model`` (a transformers MoE causal LM) over the ranks of
    ``ep`` (a 1-D device mesh, or a process group, made one): each MoE block's ``experts``
    becomes an ``ExpertParallelExperts`` holding this rank's E / ep experts. Every rank of
    ``ep`` calls it on the same model (the same weights). Refuses what
    ``check_expert_parallel`` refuses, before any block is changed."""
    if not isinstance(ep, DeviceMesh):
        device = next(model.parameters()).device.type
        ep = DeviceMesh.from_group(ep, device)
    if ep.ndim != 1:
        raise ValueError(f"expert parallelism takes a 1-D mesh, not {ep.ndim}-D")
    routers = check_expert_parallel(model, ep.size())
    names = {id(module): name for name, module in model.named_modules()}
    modules = {}
    for block in routers.blocks:
        parallel = ExpertParallelExperts(block.experts, ep, routers.num_experts)
        modules[names[id(block.experts)]] = parallel
        block.experts = parallel
    return ExpertShards(ep.size(), ep.get_local_rank(), modules)
