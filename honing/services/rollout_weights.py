"""Weight updates of ``honing serve rollout``: safetensors read from a directory, a request
body, or the bodies of several requests (``Staged``), every tensor checked against the
served model, then applied all at once.

A tensor must name a weight of the served model, have its shape, be of its kind (any
floating-point dtype for a floating-point weight, cast to the served dtype; the same dtype
otherwise) and be finite in the served dtype. One that is not refuses the whole update (400,
naming the tensor and what was expected) before any weight is touched (the engine's
``load_weights`` then copies them), so that a server never samples from a mix of two
versions, nor from weights that ``copy_`` broadcast into the wrong shape. Weights not sent
keep their values (a tied weight comes once, under either name).

An update sent bucket by bucket is staged apart from the served weights and applied only by
its commit, once every bucket came: a refused bucket drops the whole update, and one whose
client went away mid-way is never applied (the next update's first bucket replaces it). It is
a trainer's whole model, so its commit also checks that it holds every weight of the served
model (a tied weight once, under either name: ``check_complete``): a policy with fewer layers
than the served model (each of its tensors a name and shape the server has) would otherwise
leave the extra layers' weights as they were, and the server would sample from a mix. So is
an update read from a directory (a model's or a trainer's ``disk`` sync).

One trainer at a time sends a server weights (``honing.rollout.remote.hold``): every weight
request passes ``hold_for`` first, and one from a trainer other than the one that holds the
server is a 409.
"""

from __future__ import annotations

import json
import math
import threading
import warnings
from pathlib import Path

import torch

from honing.rollout.remote.hold import TRAINER_HEADER, HeldElsewhere, Holder
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


# safetensors' dtype names
DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip


def from_body(data: bytes | bytearray) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file sent as a request body, read in place: each tensor a
    view of ``data`` (which it keeps alive), none copied; one whose bytes are not aligned to
    its dtype is copied out.

    Raises:
        Refused: the body is not a safetensors file (a header that does not parse, a dtype it
            does not name, a tensor whose bytes are not its shape's or lie outside the body).
    """
    try:
        with warnings.catch_warnings():  # a bytes body is read-only: its views are only read
            warnings.filterwarnings("ignore", "The given buffer is not writable")
            return _tensors_in(memoryview(data))
    except Refused:
        raise
    except Exception as err:  # noqa: BLE001 - any parse failure is the client's
        raise Refused(f"body: not a safetensors file ({err})") from None


def _tensors_in(data: memoryview) -> dict[str, torch.Tensor]:
    if len(data) < 8:
        raise Refused("body: not a safetensors file (shorter than its header's length)")
    length = int.from_bytes(data[:8], "little")
    if length > len(data) - 8:
        raise Refused("body: not a safetensors file (its header runs past the body)")
    header = json.loads(bytes(data[8 : 8 + length]))
    start, tensors = 8 + length, {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = DTYPES.get(entry["dtype"])
        if dtype is None:
            raise Refused(f"body: {name} has dtype {entry['dtype']}, which honing does not read")
        shape = [int(size) for size in entry["shape"]]
        begin, end = (int(offset) for offset in entry["data_offsets"])
        itemsize = dtype.itemsize
        if min(shape, default=0) < 0 or not 0 <= begin <= end <= len(data) - start:
            raise Refused(f"body: not a safetensors file ({name} lies outside the body)")
        if end - begin != math.prod(shape) * itemsize:
            raise Refused(f"body: not a safetensors file ({name}'s bytes are not its shape's)")
        view = data[start + begin : start + end]
        if not view.nbytes:
            tensors[name] = torch.empty(shape, dtype=dtype)
        elif (start + begin) % itemsize:  # unaligned: a copy of its own
            tensors[name] = torch.frombuffer(bytearray(view), dtype=dtype).view(shape)
        else:
            tensors[name] = torch.frombuffer(view, dtype=dtype).view(shape)
    return tensors


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
        if not _finite(cast):  # NaN and infinity stay so when cast
            if cast is tensor or not _finite(tensor):
                raise Refused(f"weights: {name} has non-finite values (NaN or infinity)")
            raise Refused(f"weights: {name} has values beyond {target.dtype}'s range")


def _finite(tensor: torch.Tensor) -> bool:
    """Whether every value is finite: its largest and smallest are (a NaN is both), two
    reductions over the tensor with no mask of its size."""
    if not tensor.numel():
        return True
    return bool(torch.isfinite(tensor.amax())) and bool(torch.isfinite(tensor.amin()))


def check_complete(names, own: dict[str, torch.Tensor]) -> None:
    """Raises ``Refused`` naming the first weight of ``own`` (the served model's state dict)
    that ``names`` leave out; a weight tied to another (the same storage: an output head
    tied to the embeddings) counts as sent when either name is."""
    sent = set(names)
    tied: dict[tuple, set[str]] = {}
    for name, tensor in own.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.shape)
        tied.setdefault(key, set()).add(name)
    missing = [group for group in tied.values() if not group & sent]
    if missing:
        first = min(min(group) for group in missing)
        raise Refused(
            f"weights: the update lacks {len(missing)} of the served model's "
            f"{len(tied)} weights (first: {first}): the policy is not the served model; "
            "serve the policy's model"
        )


def hold_for(holder: Holder, headers) -> None:
    """Gives the server to the trainer a weight request names (its ``X-Honing-Trainer``
    header), or renews its hold (``honing.rollout.remote.hold``).

    Raises:
        Refused: (409) another trainer holds the server.
    """
    try:
        holder.hold(headers.get(TRAINER_HEADER, ""))
    except HeldElsewhere as err:
        raise Refused(str(err), 409) from None


class Staged:
    """The update that arrives in several requests: its id (the client's), the buckets
    taken so far and their tensors, cast to the served dtypes. One at a time: the first
    bucket of another update replaces it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.update, self.parts = "", 0
        self.tensors: dict[str, torch.Tensor] = {}
        self.own: dict[str, torch.Tensor] = {}  # the served model's, as the first part saw it

    def add(self, update: str, part: int, data: bytes, own: dict[str, torch.Tensor]) -> int:
        """Stages bucket ``part`` (a safetensors body) of ``update``; returns the buckets
        staged so far.

        Raises:
            Refused: not the update in progress or not its next part, a body that is not
                safetensors, a tensor that does not fit ``own`` or came before in this
                update; the update is dropped (its commit is refused).
        """
        with self.lock:
            if part == 0:
                self.update, self.parts, self.tensors, self.own = update, 0, {}, own
            elif update != self.update:
                raise Refused(f"update: {update} is not in progress (its first part is 0)")
            try:
                if part != self.parts:
                    raise Refused(f"part: expected {self.parts}, got {part}")
                weights = from_body(data)
                check_weights(weights, own)
                again = sorted(set(weights) & set(self.tensors))
                if again:
                    raise Refused(f"weights: {again[0]} came twice in update {update}")
            except Refused:
                self._drop()
                raise
            for name, tensor in weights.items():
                self.tensors[name] = tensor.to(own[name].dtype)
            self.parts += 1
            return self.parts

    def take(self, update: str, parts: int) -> dict[str, torch.Tensor]:
        """The tensors of ``update``, once all its ``parts`` buckets are staged and they
        hold every weight of the served model (``check_complete``); nothing is staged
        afterwards.

        Raises:
            Refused: ``update`` is not staged (dropped, replaced or never begun), has
                another number of buckets, or lacks a weight; the update is dropped.
        """
        with self.lock:
            if update != self.update or not self.update:
                raise Refused(f"update: {update} is not staged (dropped or never begun)")
            if parts != self.parts:
                staged = self.parts
                self._drop()
                raise Refused(f"parts: {parts} sent, {staged} staged; the update is dropped")
            tensors, own = self.tensors, self.own
            self._drop()
            check_complete(tensors, own)
            return tensors

    def _drop(self) -> None:
        self.update, self.parts, self.tensors, self.own = "", 0, {}, {}
