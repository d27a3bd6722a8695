"""honing's weight-transfer engine inside a vLLM server's workers (``--weight-transfer-config
'{"backend": "honing"}'``): each ``/update_weights`` names a bucket file the trainer wrote
(``honing.rollout.vllm.weights``), which the worker loads through vLLM's layerwise reload
and deletes. It runs on any device vLLM runs on, CPUs included, where vLLM's own engines
(NCCL, CUDA IPC) need CUDA.

vLLM imports this module in its worker processes only (the factory's lazy path, registered
by ``weights.register``), so it imports vllm at the top; nothing in honing imports it.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from honing.rollout.vllm.weights import begin_reload, finish_reload, load_pieces, read_bucket


@dataclass
class BucketInitInfo(WeightTransferInitInfo):
    """Nothing to set up: files need no rendezvous."""


@dataclass
class BucketUpdateInfo(WeightTransferUpdateInfo):
    """One bucket: the path of its safetensors file."""

    path: str


class SharedMemoryTransfer(WeightTransferEngine[BucketInitInfo, BucketUpdateInfo]):
    """Loads the bucket files an update names (see the module)."""

    init_info_cls = BucketInitInfo
    update_info_cls = BucketUpdateInfo

    def init_transfer_engine(self, init_info: BucketInitInfo) -> None:
        pass

    def start_weight_update(self) -> None:
        begin_reload(self.model)

    def update_weights(self, update_info: dict) -> None:
        """The base class's, without its ``torch.accelerator.synchronize()`` (which raises
        where there is no accelerator); loading from a file is synchronous."""
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: BucketUpdateInfo) -> None:
        load_pieces(self.model, read_bucket(update_info.path))

    def finish_weight_update(self) -> None:
        finish_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        pass
