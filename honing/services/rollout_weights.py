"""Weight updates of ``honing serve rollout``: safetensors read from a directory or a request
body, every tensor checked against the served model, then applied all at once.

A tensor must name a weight of the served model, have its shape, be of its kind (any
floating-point dtype for a floating-point weight, cast to the served dtype; the same dtype
otherwise) and be finite in the served dtype. One that is not refuses the whole update (400,
naming the tensor and what was expected) before any weight is touched (the engine's
``load_weights`` then copies them), so that a server never
samples from a mix of two versions, nor from weights that ``copy_`` broadcast into the wrong
shape. Weights not sent keep their values (a tied weight comes once, under either name).
"""

from __future__ import annotations

from pathlib import Path

import torch

from honing.services.app import Refused


def from_directory(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of every ``*.safetensors`` file in ``path``.

    Raises:
        Refused: ``path`` holds no such file, or one that is not a safetensors file.
    """
    from safetensors.torch import load_file

    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise Refused(f"model_path: no *.safetensors files in {path}")
    weights: dict[str, torch.Tensor] = {}
    for shard in shards:
        try:
            weights.update(load_file(shard))
        except Exception as err:  # noqa: BLE001 - a damaged file is the client's to fix
            raise Refused(f"model_path: {shard.name} is not a safetensors file ({err})") from None
    return weights


def from_body(data: bytes) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file sent as a request body.

    Raises:
        Refused: the body is not a safetensors file.
    """
    from safetensors.torch import load

    try:
        return load(data)
    except Exception as err:  # noqa: BLE001 - any parse failure is the client's
        raise Refused(f"body: not a safetensors file ({err})") from None


def check_weights(weights: dict[str, torch.Tensor], own: dict[str, torch.Tensor]) -> None:
    """Raises ``Refused`` naming the first tensor of ``weights`` that does not fit ``own`` (the
    served model's state dict): an unknown name, another shape, another kind of dtype, or
    values that are not finite in the served dtype."""
    unknown = sorted(set(weights) - set(own))
    if unknown:
        raise Refused(f"weights do not fit the served model: unknown {unknown[:3]}")
    for name, tensor in weights.items():
        target = own[name]
        if tensor.shape != target.shape:
            raise Refused(
                f"weights: {name} has shape {tuple(tensor.shape)}; the served model's is "
                f"{tuple(target.shape)}"
            )
        if not target.is_floating_point():
            if tensor.dtype != target.dtype:
                raise Refused(f"weights: {name} has dtype {tensor.dtype}; expected {target.dtype}")
            continue
        if not tensor.is_floating_point():
            raise Refused(
                f"weights: {name} has dtype {tensor.dtype}; expected a floating-point dtype "
                f"(cast to the served {target.dtype})"
            )
        cast = tensor.to(target.dtype)  # the same tensor when the dtypes agree
        if not bool(torch.isfinite(cast).all()):  # NaN and infinity stay so when cast
            if cast is tensor or not bool(torch.isfinite(tensor).all()):
                raise Refused(f"weights: {name} has non-finite values (NaN or infinity)")
            raise Refused(f"weights: {name} has values beyond {target.dtype}'s range")
