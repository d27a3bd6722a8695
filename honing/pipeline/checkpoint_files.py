"""The files of a checkpoint for every layout of the trained modules, written and read by
every process that holds a part of them.

    model.safetensors (or model-0000k-of-0000n.safetensors + model.safetensors.index.json),
    config.json, tokenizer files     the policy, Hugging Face format (a LoRA run's: the adapter)
    trainer_state.pt                 the schedules and RNG states; the trainer engines' state
                                     by role when the modules were whole
    trainer/                         sharded modules: each rank's shards of the engines' state
                                     (torch.distributed.checkpoint), read at any world size

A sharded policy is exported a tensor at a time, gathered from every rank, into safetensors
files of at most ``MAX_SHARD_BYTES``: no rank ever holds the whole model to write it. Whole
checkpoints (one process, replicated ranks) and sharded ones load into either layout: whole
tensors are cut into this rank's shards, shards are put together into whole tensors.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from honing.config import Config
from honing.errors import UserError
from honing.models.loading import is_lora, loaded_pieces, save_model, saved_pieces
from honing.pipeline.components import Components

TRAINER_STATE = "trainer_state.pt"
SHARDS = "trainer"
MAX_SHARD_BYTES = 2 << 30
_INDEX = "model.safetensors.index.json"


def write_policy(parts: Components, directory: Path, writer: bool) -> None:
    """The policy in Hugging Face format; a sharded one gathered a tensor at a time, every
    rank taking part and ``writer`` (rank 0) writing."""
    policy = parts.trainers.policy
    if not policy.is_sharded:
        if writer:
            save_model(parts.policy, parts.tokenizer, directory)
        return
    module = policy.module
    if is_lora(module):  # the adapters only, as PEFT writes them
        from peft.utils import get_peft_model_state_dict
        from safetensors.torch import save_file

        def adapters(module):
            return (item for item in module.state_dict().items() if "lora_" in item[0])

        whole = {name: t.detach().cpu() for name, t in policy.whole_tensors(adapters)}
        if writer:
            state = get_peft_model_state_dict(module, state_dict=whole)
            save_file(state, str(directory / "adapter_model.safetensors"), {"format": "pt"})
            module.peft_config["default"].save_pretrained(directory)
            parts.tokenizer.save_pretrained(directory)
        return
    from honing.rollout.native.fast_decode import unwrap

    base = unwrap(module)
    write_weight_files(saved_pieces(base, policy.whole_tensors()), directory, writer)
    if writer:
        base.config.save_pretrained(directory)
        if getattr(base, "generation_config", None) is not None:
            base.generation_config.save_pretrained(directory)
        parts.tokenizer.save_pretrained(directory)


def write_weight_files(pieces: Iterable[tuple[str, torch.Tensor]], directory: Path, writer: bool):
    """Safetensors files of at most ``MAX_SHARD_BYTES`` from ``pieces`` (consumed on every
    rank: gathering them is collective), named as Hugging Face names them."""
    from safetensors.torch import save_file

    written, current, size = [], {}, 0

    def flush() -> None:
        nonlocal current, size
        path = directory / f".part-{len(written)}.safetensors"
        save_file(current, str(path), {"format": "pt"})
        written.append((path, list(current)))
        current, size = {}, 0

    total = 0
    for name, tensor in pieces:
        if not writer:
            continue
        tensor = tensor.detach().to("cpu").contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > MAX_SHARD_BYTES:
            flush()
        current[name], size, total = tensor, size + nbytes, total + nbytes
    if not writer:
        return
    if current:
        flush()
    if len(written) == 1:
        written[0][0].rename(directory / "model.safetensors")
        return
    weight_map = {}
    for index, (path, names) in enumerate(written, start=1):
        final = f"model-{index:05d}-of-{len(written):05d}.safetensors"
        path.rename(directory / final)
        weight_map |= dict.fromkeys(names, final)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / _INDEX).write_text(json.dumps(index, indent=1))


def weight_pieces(checkpoint: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a checkpoint's safetensors files, one at a time (memory-mapped)."""
    from safetensors import safe_open

    for shard in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                yield name, handle.get_tensor(name)


def load_policy(parts: Components, checkpoint: Path) -> None:
    """A checkpoint's policy weights (the adapters of a LoRA run) into the policy, whole or
    sharded (then on every rank)."""
    from safetensors.torch import load_file

    if parts.trainers.policy.is_sharded:
        return load_sharded_policy(parts, checkpoint)
    if is_lora(parts.policy):
        return _load_adapter(parts, checkpoint)
    weights = {}
    for shard in sorted(checkpoint.glob("*.safetensors")):
        weights.update(load_file(shard, device=str(parts.device)))
    weights = dict(loaded_pieces(parts.policy, weights.items()))
    tied = getattr(parts.policy.config, "tie_word_embeddings", False)
    try:
        missing, unexpected = parts.policy.load_state_dict(weights, strict=False)
    except RuntimeError as err:  # shape mismatch: another model's checkpoint
        first = str(err).strip().splitlines()[-1].strip()
        raise UserError(
            f"checkpoint {checkpoint} does not fit model.path's model ({first}); resume it "
            "with the model.path it was trained from"
        ) from None
    # A tied output head is saved once, as the embedding; anything else missing is wrong.
    missing = [k for k in missing if not (tied and k.startswith("lm_head"))]
    if missing or unexpected or not weights:
        raise UserError(
            f"checkpoint {checkpoint} does not fit model.path's model (missing "
            f"{missing[:3]}, unexpected {unexpected[:3]}); resume it with the model.path it "
            "was trained from"
        )
    if tied:
        parts.policy.tie_weights()


def _load_adapter(parts: Components, checkpoint: Path) -> None:
    """A LoRA run's checkpoint holds the adapters (PEFT's format); the base is model.path."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    adapter = checkpoint / "adapter_model.safetensors"
    if not adapter.exists():
        raise UserError(
            f"checkpoint {checkpoint} holds no LoRA adapter (adapter_model.safetensors): it was "
            "not trained with model.lora_rank > 0; resume it with the same model.lora_* keys"
        )
    weights = load_file(adapter, device=str(parts.device))
    try:
        result = set_peft_model_state_dict(parts.policy, weights)
    except RuntimeError as err:  # another rank or other target modules
        first = str(err).strip().splitlines()[-1].strip()
        raise UserError(
            f"checkpoint {checkpoint}'s adapters do not fit model.lora_* ({first})"
        ) from None
    expected = {k for k in parts.policy.state_dict() if "lora_" in k}
    missing = [k for k in result.missing_keys if k in expected]
    if result.unexpected_keys or missing or not weights:
        raise UserError(
            f"checkpoint {checkpoint}'s adapters do not fit model.lora_* (missing {missing[:3]}, "
            f"unexpected {list(result.unexpected_keys)[:3]})"
        )


def load_sharded_policy(parts: Components, checkpoint: Path) -> None:
    """A checkpoint's Hugging Face weights into the sharded policy, a tensor at a time on
    every rank (each keeps its shards); names that do not fit are a ``UserError``."""
    policy = parts.trainers.policy
    module = policy.module
    own = set(module.state_dict())
    pieces = weight_pieces(checkpoint)
    if is_lora(module):  # PEFT saves adapters without their adapter name
        by_saved = {name.replace(".default", ""): name for name in own if "lora_" in name}
        pieces = ((by_saved.get(name, name), tensor) for name, tensor in pieces)
        own = set(by_saved.values())
    else:  # as save_pretrained wrote them
        pieces = loaded_pieces(module, pieces)
    loaded = []

    def counted():
        for name, tensor in pieces:
            loaded.append(name)
            yield name, tensor

    unknown = policy.load_tensors(counted())
    tied = getattr(module.config, "tie_word_embeddings", False)
    missing = [k for k in own - set(loaded) if not (tied and k.endswith("lm_head.weight"))]
    if unknown or missing or not loaded:
        raise UserError(
            f"checkpoint {checkpoint} does not fit model.path's model (missing "
            f"{sorted(missing)[:3]}, unexpected {unknown[:3]}); resume it with the model.path "
            "and model.lora_* keys it was trained with"
        )


def engine_states(parts: Components, config: Config) -> dict[str, dict]:
    """Each trainer engine's state by role (the policy's weights are the Hugging Face files)."""
    policy = parts.trainers.policy
    return {
        trainer.role: trainer.state(
            module=trainer is not policy, optimizer=config.checkpoint.save_optimizer
        )
        for trainer in parts.trainers.all()
    }


def write_trainer_state(parts: Components, config: Config, directory: Path, writer: bool):
    """The engines' state: whole in ``trainer_state.pt``, or each rank's shards in
    ``trainer/`` (sharded) with the schedules in ``trainer_state.pt``."""
    policy = parts.trainers.policy
    states = engine_states(parts, config)
    rng = {"rng": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda_rng"] = torch.cuda.get_rng_state_all()
    if not policy.is_sharded:
        if writer:
            torch.save({"trainers": states, **rng}, directory / TRAINER_STATE)
        return
    if not writer:  # the MTP heads train on rank 0 alone: its copy is the one saved
        states.pop("mtp", None)
    schedules = {role: s.pop("scheduler") for role, s in states.items() if "scheduler" in s}
    policy.save_shards(states, directory / SHARDS)
    if writer:
        kept = {role: sorted(state) for role, state in states.items()}
        torch.save({"schedules": schedules, "sharded": kept, **rng}, directory / TRAINER_STATE)


def load_engine_states(parts: Components, checkpoint: Path, state: dict) -> dict[str, dict]:
    """The engines' state as ``state`` (``trainer_state.pt``) and the checkpoint's shards
    hold it, by role, shaped for this run's layout (read at any world size)."""
    if "sharded" not in state:
        return state["trainers"]
    kept = state["sharded"]
    template = {}
    for trainer in parts.trainers.all():
        if trainer.role not in kept:
            continue
        fields = kept[trainer.role]
        full = trainer.state(
            module="module" in fields, optimizer="optimizer" in fields, template=True
        )
        template[trainer.role] = {key: full[key] for key in fields}
    parts.trainers.policy.load_shards(template, checkpoint / SHARDS)
    for role, schedule in state["schedules"].items():
        template.setdefault(role, {})["scheduler"] = schedule
    return template
