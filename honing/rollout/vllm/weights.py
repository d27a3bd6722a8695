"""What both sides of a weight update into vLLM share: the shared-memory bucket files that
carry the weights to a vLLM server's workers, the plugin that registers honing's transfer
engine with vLLM, and the repair of a tied output head after vLLM reloads weights.

The transport (``rollout.weight_sync=vllm`` against a server launched with
``--weight-transfer-config '{"backend": "honing"}'``): the trainer writes each bucket of
weights as a safetensors file (``write_bucket``) in a directory the server's workers see
(``/dev/shm`` by default: memory, not disk), and names it in ``/update_weights``; the worker
reads it (``read_bucket``), loads it through vLLM's layerwise reload and deletes it. Files,
not a gloo group, because nothing has to meet: no rendezvous, no port, no collective that
hangs when one side dies; a bucket is one file the size of the bucket.

Imports stay light here (no vllm, no torch at module level): vLLM loads ``register`` in every
one of its processes through the ``vllm.general_plugins`` entry point.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

BACKEND = "honing"  # the backend name in --weight-transfer-config
BUCKET_PREFIX = "honing-bucket-"
BUCKET_SUFFIX = ".safetensors"
# how honing's backend says an update it abandoned left layers new: the server needs a restart
PART_NEW = "abandoned with layers new"
# how it refuses a bucket that does not fit the served model, and an update that lacks a part
WONT_FIT = "weights do not fit the served model"
LACKS = "the update lacks"


def register() -> None:
    """The ``vllm.general_plugins`` entry point: makes ``honing`` a weight-transfer backend
    of vLLM (``honing.rollout.vllm.transfer``, imported only when a server uses it)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    with contextlib.suppress(ValueError):  # registered already in this process
        WeightTransferEngineFactory.register_engine(
            BACKEND, "honing.rollout.vllm.transfer", "SharedMemoryTransfer"
        )


def write_bucket(directory: str | Path, name: str, tensors: dict) -> Path:
    """``tensors`` as the safetensors file ``directory/honing-bucket-<name>.safetensors``,
    complete before it takes its name."""
    from safetensors.torch import save_file

    final = Path(directory) / f"{BUCKET_PREFIX}{name}{BUCKET_SUFFIX}"
    partial = final.with_name(f".{final.name}.partial")
    save_file(tensors, partial)
    partial.rename(final)
    return final


def read_bucket(path: str) -> list:
    """The (name, tensor) pairs of a bucket file, which is deleted once read (also when it
    cannot be read). Only honing's bucket files are read, so that a caller of the server's
    API cannot have it read or delete any other file.

    Raises:
        ValueError: ``path`` does not name a bucket file.
    """
    from safetensors.torch import load_file

    bucket = Path(path)
    if not (bucket.name.startswith(BUCKET_PREFIX) and bucket.name.endswith(BUCKET_SUFFIX)):
        raise ValueError(f"{path}: not a honing weight bucket ({BUCKET_PREFIX}*{BUCKET_SUFFIX})")
    try:
        return list(load_file(bucket).items())
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(bucket)


def served_shapes(model_path: str) -> dict[str, tuple[int, ...]]:
    """The name and shape of every tensor in the safetensors files of the directory a vLLM
    server loaded (read from their headers); empty when ``model_path`` is no such local
    directory (a hub name), which leaves the checks below out."""
    from safetensors import safe_open

    directory = Path(model_path)
    shapes: dict[str, tuple[int, ...]] = {}
    if not directory.is_dir():
        return shapes
    for shard in sorted(directory.glob("*.safetensors")):
        with safe_open(shard, framework="pt") as tensors:
            for name in tensors.keys():  # noqa: SIM118 - safe_open is not a mapping
                shapes[name] = tuple(tensors.get_slice(name).get_shape())
    return shapes


def check_pieces(pieces: list, shapes: dict[str, tuple[int, ...]], tied: bool) -> None:
    """Raises ``ValueError`` (``WONT_FIT``) naming the first piece whose name the served
    checkpoint lacks or whose shape differs from its tensor's, before any is loaded. An
    output head tied to the embeddings may come under its own name (a copy of the weights
    keeps no tie), which vLLM's model skips."""
    for name, tensor in pieces:
        if tied and name == "lm_head.weight" and name not in shapes:
            continue
        if name not in shapes:
            raise ValueError(f"{WONT_FIT}: it has no tensor {name}")
        if tuple(tensor.shape) != shapes[name]:
            raise ValueError(
                f"{WONT_FIT}: {name} has shape {tuple(tensor.shape)}; the served model's is "
                f"{shapes[name]}{_vocabulary_hint(name, tuple(tensor.shape), shapes[name])}"
            )


def _vocabulary_hint(name: str, sent: tuple[int, ...], served: tuple[int, ...]) -> str:
    """What to do when the trainer's vocabulary is larger than the served one: honing gives
    a tokenizer without a pad token one, and the embeddings a row for it."""
    vocabulary = name.endswith(("embed_tokens.weight", "lm_head.weight"))
    if not vocabulary or sent[1:] != served[1:] or sent[0] <= served[0]:
        return ""
    return (
        f" (the trainer's vocabulary has {sent[0] - served[0]} more row(s): honing adds a pad "
        "token to a tokenizer without one; serve the model as the trainer saves it, e.g. a "
        "checkpoint's export, or give the tokenizer a pad token)"
    )


def refresh_tied_head(model) -> bool:
    """Has a vLLM model's output head compute with its current weights after a layerwise
    reload; returns whether it had to.

    An output head tied to the input embeddings (``lm_head.weight`` is ``embed_tokens.weight``)
    loads no weight of its own, so the reload leaves it unprocessed: on CPU it keeps the
    oneDNN-packed copy of the old weights that its ``quant_method`` made at load time, and its
    logits stay the old model's while the rest of the model is new (greedy tokens may still
    agree; logprobs differed by up to 1.2 nats on the tiny model). Running the head's
    ``process_weights_after_loading`` again packs the new weights. Only an unquantized tied
    head is repacked: a quantized one would be processed twice.
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    head = getattr(model, "lm_head", None)
    weight = getattr(head, "weight", None)
    method = getattr(head, "quant_method", None)
    if weight is None or not isinstance(method, UnquantizedEmbeddingMethod):
        return False
    tied = any(
        module is not head and getattr(module, "weight", None) is weight
        for module in model.modules()
    )
    if tied:
        method.process_weights_after_loading(head)
    return tied


def redo_cpu_expert_packing(model) -> list:
    """On a CPU, vLLM pads and prepacks each MoE layer's expert weights for its grouped GEMM
    when they first load, and skips that step when they load again (it keeps the storage for
    CUDA graphs): a reloaded expert weight would not fit the packed storage, or would sit in
    it unpacked. Forgetting the layer's kernel makes the reload process it as a first load.
    Returns the (method, kernel) pairs forgotten, for an update that is abandoned."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return []
    forgotten = []
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if getattr(method, "moe_kernel", None) is not None:
            forgotten.append((method, method.moe_kernel))
            method.moe_kernel = None
    return forgotten


@dataclass
class Reload:
    """An update in progress: the MoE kernels put aside (``redo_cpu_expert_packing``) and
    the layers that wait for their tensors, what ``abandon_reload`` needs."""

    forgotten: list
    waiting: list


def begin_reload(model) -> Reload:
    """The start of a weight update in place: vLLM's layerwise reload set up (each layer
    processed once all its tensors have come), with the CPU expert packing redone."""
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    forgotten = redo_cpu_expert_packing(model)
    initialize_layerwise_reload(model)
    waiting = [m for m in model.modules() if m in LAYERWISE_INFO and LAYERWISE_INFO[m].can_load()]
    return Reload(forgotten, waiting)


def load_pieces(model, pieces: list) -> set[str]:
    """One bucket's (name, tensor) pieces into ``model`` during an update; returns the names
    of its parameters they loaded."""
    from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

    with disable_mtp_completeness_check():
        return set(model.load_weights(pieces) or ())


def finish_reload(model, model_config) -> None:
    """The end of an update: layers that got nothing keep their tensors, and a tied output
    head is repacked with the new embeddings (``refresh_tied_head``)."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    finalize_layerwise_reload(model, model_config)
    refresh_tied_head(model)


def abandon_reload(model, model_config, reload: Reload) -> int:
    """Ends an update that will not be finished (the trainer could not send the rest):
    every layer still waiting for tensors gets back the ones it had before the update, so
    that none is left on the meta device (vLLM's engine dies on its next step otherwise) nor
    processed from a part of its tensors. Returns how many layers hold new tensors: those
    that got all theirs on the way, which vLLM's reload copied into the model at once and
    cannot be put back (a layer padded beyond what a checkpoint holds, as an embedding
    whose vocabulary vLLM rounds up, waits for the end and so is put back). 0: the model is
    exactly as before the update.

    ``reload``: what ``begin_reload`` returned."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    new = 0
    for layer in reload.waiting:
        info = LAYERWISE_INFO.get(layer)
        if info is None or not info.can_load():
            new += 1  # processed on the way
            continue
        info.load_numel, info.loaded_weights = 0, []  # as a layer that got nothing
    finish_reload(model, model_config)
    for method, kernel in reload.forgotten:  # the expert layers put back keep their packing
        if method.moe_kernel is None:
            method.moe_kernel = kernel
    return new
