"""How many bytes a forward pass keeps for its backward pass (activation memory).

``saved_bytes`` counts, through ``torch.autograd.graph.saved_tensors_hooks``, every tensor
autograd saves while the block runs, each distinct storage once (views of one storage, and a
tensor saved by several operations, count once) and whole (a view keeps all of its storage
alive). Parameters, and any other tensors named in ``exclude``, are not activations and are
left out (a sharded parameter's shard; the whole weights FSDP gathers for a pass and autograd
keeps are counted). It counts what autograd holds, not the allocator's peak: temporaries
freed during the forward, and tensors kept outside autograd (an optimizer's state), are not
in it. Inside ``torch.utils.checkpoint`` regions only the checkpoint's inputs are saved, and
so counted.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor


@dataclass
class SavedBytes:
    """The running count of ``saved_bytes``: ``bytes`` over ``storages`` distinct storages."""

    bytes: int = 0
    storages: int = 0
    _seen: set[int] = field(default_factory=set, repr=False)

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        local = tensor
        if isinstance(tensor, DTensor):  # a tensor-parallel slice: this rank's part
            with torch.no_grad():
                local = tensor.to_local()
        storage = local.untyped_storage()
        key = storage.data_ptr()
        if key not in self._seen and storage.nbytes():
            self._seen.add(key)
            self.bytes += storage.nbytes()
            self.storages += 1
        return tensor


@contextmanager
def saved_bytes(exclude: Iterable[torch.Tensor] = ()) -> Iterator[SavedBytes]:
    """Count the bytes autograd saves for backward inside the block (``with saved_bytes(
    model.parameters()) as saved: loss = ...``; then ``saved.bytes``)."""
    counter = SavedBytes()
    for tensor in exclude:  # a sharded parameter: its local shard
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        counter._seen.add(local.untyped_storage().data_ptr())
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda tensor: tensor):
        yield counter
