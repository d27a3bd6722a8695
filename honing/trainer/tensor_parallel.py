"""Tensor parallelism for a trained module (``trainer.tensor_parallel=N``): DTensor's
``parallelize_module`` with a plan per model family, as torchtitan lays out its models.

Megatron's split of a decoder layer (https://arxiv.org/abs/1909.08053, section 3): the
attention's q/k/v projections split by output columns (``ColwiseParallel``: each rank
computes heads / N of the heads), its output projection by input rows (``RowwiseParallel``:
each rank's partial product, summed by one all-reduce); the MLP's gate and up projections by
columns, its down projection by rows. A layer costs two all-reduces of its [B, T, H]
activations forward and two backward; each rank holds 1/N of the split weights, of their
gradients and of their Adam moments. The attention of transformers 5's families reshapes its
projections to ``(-1, head_dim)``, so the module runs unchanged on its local heads
([B, T, heads / N, head_dim]); the ratio of query to key/value heads stays the same.

Embeddings, norms and the LM head stay whole on every rank (plain tensors), and so do a
mixture-of-experts layer's router and experts: every rank of a tensor-parallel group computes
the same activations between the split layers, so those parameters' gradients are alike on
its ranks, and a sum over the data-parallel slots alone gives one process's gradient. The
exception is a per-head q/k norm inside the attention (Qwen3, Gemma 3), which each rank runs
on its own heads: its weight is a replicated DTensor, whose gradient DTensor sums over the
ranks.

Limits: a family without a plan in ``PLANS`` is refused, and so are heads, key/value heads or
a split width that N does not divide; the activations between layers are whole on every rank
(no sequence-parallel norms), and the LM head is not split by vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from honing.errors import ConfigError

LayerPlan = dict[str, ParallelStyle]  # a decoder layer's Linear, by path, -> how it splits


def attention_plan(layer: nn.Module, head_norms: int | None = None) -> LayerPlan:
    """The attention's heads split over the ranks: q/k/v by columns, the output by rows.

    ``head_norms``: the dimension of the heads in the input of the attention's per-head
    q/k norms (Qwen3's, Gemma 3's), whose weight every rank applies to its own heads: the
    weight is replicated and its input marked split along that dimension (DTensor's
    ``SequenceParallel`` style, here on heads), so its gradient is summed over the ranks'
    heads as one process sums it over all of them."""
    plan = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
    }
    if head_norms is not None:
        for norm in ("self_attn.q_norm", "self_attn.k_norm"):
            plan[norm] = SequenceParallel(sequence_dim=head_norms, use_local_output=True)
    return plan


def mlp_plan() -> LayerPlan:
    """A gated MLP's hidden width split: gate and up by columns, down by rows."""
    return {
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }


def dense_plan(layer: nn.Module, head_norms: int | None = None) -> LayerPlan:
    """A dense decoder layer (Llama, Mistral, Qwen2/3, Gemma 1-3): attention and MLP split."""
    return attention_plan(layer, head_norms) | mlp_plan()


def moe_plan(layer: nn.Module, head_norms: int | None = None) -> LayerPlan:
    """A mixture-of-experts family's layer: the attention split; the MLP only where the layer
    has a dense one (Qwen3-MoE's ``mlp_only_layers``), the experts and router whole."""
    plan = attention_plan(layer, head_norms)
    if isinstance(getattr(getattr(layer, "mlp", None), "gate_proj", None), nn.Linear):
        plan |= mlp_plan()
    return plan


# transformers' model_type -> the plan of each of its decoder layers. Qwen3's q/k norms see
# [B, T, heads, D] (the heads at 2), Gemma 3's [B, heads, T, D] (at 1).
PLANS: dict[str, Callable[[nn.Module], LayerPlan]] = {
    "llama": dense_plan,
    "mistral": dense_plan,
    "qwen2": dense_plan,
    "qwen3": partial(dense_plan, head_norms=2),
    "gemma": dense_plan,
    "gemma2": dense_plan,
    "gemma3_text": partial(dense_plan, head_norms=1),
    "qwen3_moe": partial(moe_plan, head_norms=2),
    "mixtral": moe_plan,
}


HEADS = {"num_attention_heads": "attention heads", "num_key_value_heads": "key/value heads"}


def layer_plans(model: nn.Module, size: int) -> list[tuple[nn.Module, LayerPlan]]:
    """Each decoder layer of ``model`` (a causal LM) with its plan for ``size`` ranks.

    Raises:
        ConfigError: the family has no plan, or ``size`` does not divide its heads, its
            key/value heads or the width a planned projection splits.
    """
    key = f"trainer.tensor_parallel={size}"
    config = getattr(model, "config", None)
    family = getattr(config, "model_type", None)
    name = type(model).__name__
    layers = getattr(getattr(model, "model", None), "layers", None)
    if family not in PLANS or not isinstance(layers, nn.ModuleList):
        raise ConfigError(
            f"{key}: {name} (model_type {family}) has no tensor-parallel plan; plans exist "
            f"for {', '.join(sorted(PLANS))}: set trainer.tensor_parallel=1 for this model"
        )
    for field, what in HEADS.items():
        count = getattr(config, field)
        if count % size:
            raise ConfigError(
                f"{key}: {name}'s {count} {what} ({field}) do not divide by {size}; choose a "
                "trainer.tensor_parallel that divides them"
            )
    plans = []
    for layer in layers:
        plan = PLANS[family](layer)
        for path, style in plan.items():
            linear = layer.get_submodule(path)
            if not isinstance(linear, nn.Linear):  # a head norm: nothing to divide
                continue
            columns = isinstance(style, ColwiseParallel)
            width = linear.out_features if columns else linear.in_features
            if width % size:
                raise ConfigError(
                    f"{key}: {name}'s {path} has {width} {'output' if columns else 'input'} "
                    f"features, which do not divide by {size}"
                )
        plans.append((layer, plan))
    return plans


def parallelize(module: nn.Module, mesh: DeviceMesh | None) -> nn.Module:
    """``module`` (a causal LM, or a critic on one's ``backbone``) split in place over the
    1-D tensor-parallel ``mesh``, each decoder layer by its family's plan; unchanged without
    a mesh. Every rank holds the same whole weights before: each keeps its own slice (no
    communication)."""
    if mesh is None:
        return module
    model = getattr(module, "backbone", module)
    for layer, plan in layer_plans(model, mesh.size()):
        parallelize_module(layer, mesh, plan, src_data_rank=None)
    return module
