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

Each bucket is checked against the checkpoint the server loaded (the headers of its
safetensors files), before any of it loads: a name it lacks or another shape refuses the
bucket (``WONT_FIT``), and the update is abandoned. An update that left a parameter of vLLM's
model without weights (a policy with fewer layers than the served model; as
``VLLMEngine.load_weights`` checks in process) is said when the trainer confirms it after
``/finish_weight_update`` (``LACKS``): vLLM's reload has loaded the rest by
then, so that server holds a mix and needs a restart, but the run stops at its first sync.

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
    LACKS,
    PART_NEW,
    WONT_FIT,
    Reload,
    abandon_reload,
    begin_reload,
    check_pieces,
    finish_reload,
    load_pieces,
    read_bucket,
    served_shapes,
)


@dataclass
class BucketInitInfo(WeightTransferInitInfo):
    """Files need no rendezvous: what is set up is which trainer the server holds to
    (``honing.rollout.remote.hold``): ``trainer`` takes or renews the hold, or with
    ``release`` lets go of it. ``confirm``: asked after an update is finished, whether it
    held every tensor of the served model."""

    trainer: str = ""
    release: bool = False
    confirm: bool = False


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
        self._shapes: dict | None = None  # the served checkpoint's, read at the first update
        self._expected: set[str] = set()  # the model's parameters (a tied one once)
        self._loaded: set[str] = set()  # those the update in progress loaded
        self._lacking = ""

    def init_transfer_engine(self, init_info: BucketInitInfo) -> None:
        """Takes, renews or lets go of the trainer's hold.

        Raises:
            RuntimeError: another trainer holds the server (``hold.HELD``).
        """
        if init_info.confirm:
            lacking, self._lacking = self._lacking, ""
            if lacking:
                raise RuntimeError(
                    f"honing: {LACKS} vLLM's {lacking} of the served model (it keeps its old "
                    "values beside the new ones): the policy is not the served model"
                )
            return
        if init_info.release:
            self._holder.release(init_info.trainer)
            return
        try:
            self._holder.hold(init_info.trainer)
        except HeldElsewhere as err:
            raise RuntimeError(str(err)) from None

    def start_weight_update(self) -> None:
        if self._shapes is None:
            self._shapes = served_shapes(self.model_config.model)
        self._expected = {name for name, _ in self.model.named_parameters()}
        self._loaded, self._lacking = set(), ""
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
            pieces = read_bucket(update_info.path)
            if self._shapes:
                check_pieces(pieces, self._shapes, self._tied())
            self._loaded |= load_pieces(self.model, pieces)
        except BaseException as err:
            new = self._abandon()
            if WONT_FIT in str(err):
                said = PART_NEW if new else "abandoned with nothing loaded"
                raise ValueError(f"honing: {err}; the update is {said}") from None
            raise

    def finish_weight_update(self) -> None:
        if self._abandoned:
            return
        self._lacking = min(self._expected - self._loaded, default="")
        finish_reload(self.model, self.model_config)

    def _tied(self) -> bool:
        return bool(getattr(self.model_config.hf_config, "tie_word_embeddings", False))

    def _abandon(self) -> int:
        """``abandon_reload`` once: the layers that hold new tensors."""
        if self._abandoned:
            return 0
        self._abandoned = True
        return abandon_reload(self.model, self.model_config, self._reload)

    def shutdown(self) -> None:
        pass
