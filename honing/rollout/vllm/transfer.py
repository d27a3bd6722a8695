"""honing's weight-transfer engine inside a vLLM server's workers (``--weight-transfer-config
'{"backend": "honing"}'``): each ``/update_weights`` names a bucket file the trainer wrote
(``honing.rollout.vllm.weights``), which the worker loads through vLLM's layerwise reload
and deletes. It runs on any device vLLM runs on, CPUs included, where vLLM's own engines
(NCCL, CUDA IPC) need CUDA.

An update is never left half-way in the model: one the trainer abandons (``{"abandon":
true}``: it could not write the rest) or a bucket that fails to load puts every layer not yet
complete back as it was (``weights.abandon_reload``), so the engine keeps running. Layers that
were complete keep the new tensors: the abandon then fails saying so (``PART_NEW``), which
the trainer reports (the server needs a restart); otherwise the model is as before the update
and the trainer finishes it with the old version.

A server holds to one trainer at a time (``honing.rollout.remote.hold``): the trainer asks for
it through ``/init_weight_transfer_engine`` before each sync pauses the server, and renews it
while it lives; another trainer is refused there, before it pauses anything.

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

from honing.rollout.remote.hold import HeldElsewhere, Holder
from honing.rollout.vllm.weights import (
    PART_NEW,
    Reload,
    abandon_reload,
    begin_reload,
    finish_reload,
    load_pieces,
    read_bucket,
)


@dataclass
class BucketInitInfo(WeightTransferInitInfo):
    """Files need no rendezvous: what is set up is which trainer the server holds to
    (``honing.rollout.remote.hold``): ``trainer`` takes or renews the hold, or with
    ``release`` lets go of it."""

    trainer: str = ""
    release: bool = False


@dataclass
class BucketUpdateInfo(WeightTransferUpdateInfo):
    """One bucket: the path of its safetensors file; or ``abandon``: the update ends here,
    unfinished (its ``/finish_weight_update`` then changes nothing more)."""

    path: str = ""
    abandon: bool = False


class SharedMemoryTransfer(WeightTransferEngine[BucketInitInfo, BucketUpdateInfo]):
    """Loads the bucket files an update names (see the module)."""

    init_info_cls = BucketInitInfo
    update_info_cls = BucketUpdateInfo

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._reload = Reload([], [])
        self._abandoned = False
        self._holder = Holder()

    def init_transfer_engine(self, init_info: BucketInitInfo) -> None:
        """Takes, renews or lets go of the trainer's hold.

        Raises:
            RuntimeError: another trainer holds the server (``hold.HELD``).
        """
        if init_info.release:
            self._holder.release(init_info.trainer)
            return
        try:
            self._holder.hold(init_info.trainer)
        except HeldElsewhere as err:
            raise RuntimeError(str(err)) from None

    def start_weight_update(self) -> None:
        self._reload = begin_reload(self.model)
        self._abandoned = False

    def update_weights(self, update_info: dict) -> None:
        """The base class's, without its ``torch.accelerator.synchronize()`` (which raises
        where there is no accelerator); loading from a file is synchronous."""
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: BucketUpdateInfo) -> None:
        """Loads the bucket, or abandons the update; a bucket that fails to load abandons it
        too (vLLM's worker ends the update on the error, leaving the model as it is).

        Raises:
            RuntimeError: the update, abandoned, left layers new (``PART_NEW``): the model is
                part old, part new, and vLLM's worker ends the update.
        """
        if update_info.abandon:
            new = self._abandon()
            if new:
                raise RuntimeError(
                    f"honing: weight update {PART_NEW} ({new} layers got all their tensors "
                    "first and keep them; the others keep theirs): restart the server"
                )
            return
        if self._abandoned:
            raise RuntimeError("this weight update was abandoned: start another")
        try:
            load_pieces(self.model, read_bucket(update_info.path))
        except BaseException:
            self._abandon()
            raise

    def finish_weight_update(self) -> None:
        if not self._abandoned:
            finish_reload(self.model, self.model_config)

    def _abandon(self) -> int:
        """``abandon_reload`` once: the layers that hold new tensors."""
        if self._abandoned:
            return 0
        self._abandoned = True
        return abandon_reload(self.model, self.model_config, self._reload)

    def shutdown(self) -> None:
        pass
