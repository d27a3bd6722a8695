"""Load and save Hugging Face causal LMs from local directories (never from a hub)."""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from honing.errors import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PAD_TOKEN = "<|honing_pad|>"

# Weights come from local directories only; make that explicit for every library underneath.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def quiet_transformers() -> None:
    """No per-file progress bars or advisory warnings from transformers on the console."""
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()


def resolve_device(name: str) -> torch.device:
    """``auto`` picks CUDA when present; asking for CUDA without it is a config error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("model.device: cuda requested but torch sees no CUDA device; use cpu")
    return torch.device(name)


def check_model_dir(path: str | Path, key: str = "model.path") -> Path:
    """``path`` as a model directory: a ``config.json`` that is a JSON object, else a
    ConfigError naming ``key`` (checked before the tokenizer, which reads it too)."""
    path = Path(path).expanduser()
    config = path / "config.json"
    if not config.is_file():
        raise ConfigError(
            f"{key}: {path} is not a Hugging Face model directory (no config.json); "
            "give a local directory or builtin:tiny"
        )
    try:
        parsed = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ConfigError(f"{key}: {config} is not valid JSON ({_first_line(err)})") from None
    if not isinstance(parsed, dict):
        raise ConfigError(f"{key}: {config} is not a JSON object")
    return path


def load_tokenizer(path: str | Path, *, trust_remote_code: bool = False):
    """The model's tokenizer, with a pad token distinct from EOS (added if it has none)."""
    from transformers import AutoTokenizer

    quiet_transformers()
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as err:
        raise ConfigError(
            f"model.path: cannot load a tokenizer from {path} ({_first_line(err)}); expected "
            "the tokenizer files (tokenizer.json or tokenizer_config.json + vocabulary)"
        ) from None
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"model.path: the tokenizer in {path} has no EOS token")
    if tokenizer.pad_token_id is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        # A pad equal to EOS invites masks that hide the final EOS from the loss.
        tokenizer.add_special_tokens({"pad_token": PAD_TOKEN})
    return tokenizer


def load_causal_lm(
    path: str | Path,
    tokenizer,
    *,
    dtype: str,
    device: torch.device,
    trust_remote_code: bool = False,
):
    """Load a causal LM for training; grow its embeddings if the tokenizer gained a pad token."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError, KeyError, SafetensorError) as err:  # missing, torn, wrong
        raise ConfigError(
            f"model.path: cannot load a causal LM from {path} ({_first_line(err)}); expected "
            "config.json and weights (*.safetensors or pytorch_model.bin)"
        ) from None
    disable_dropout(model)
    if len(tokenizer) > model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(len(tokenizer))
    model.config.pad_token_id = tokenizer.pad_token_id
    return model.to(device)


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def disable_dropout(model) -> None:
    """Dropout off for RL, as TRL does by default: with dropout, the policy's logprobs differ
    between the old-policy pass and the update pass, so the PPO ratio is not 1 on-policy and
    the KL to the (eval-mode) reference is biased. The module stays in train mode, so
    gradient checkpointing still works."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name in ("attention_dropout", "dropout", "attn_dropout"):
            if isinstance(getattr(module, name, None), float):
                setattr(module, name, 0.0)


# transformers before 5.23 names activation checkpointing "gradient checkpointing"; from 5.23
# it is "activation checkpointing", and each use of the old names warns (they go in 6). These
# two take whichever the installed release has.


def set_activation_checkpointing(model, on: bool) -> None:
    """Recompute each decoder layer's activations in the backward pass (less memory, one more
    forward), or stop doing so."""
    action = "enable" if on else "disable"
    method = getattr(model, f"activation_checkpointing_{action}", None)
    (method or getattr(model, f"gradient_checkpointing_{action}"))()


def activation_checkpointing(model) -> bool:
    """Whether activation checkpointing is on for ``model`` (a LoRA wrapper reads its base)."""
    on = getattr(model, "is_activation_checkpointing", None)
    return bool(getattr(model, "is_gradient_checkpointing", False) if on is None else on)


def save_model(model, tokenizer, directory: str | Path) -> None:
    """Write ``model`` and ``tokenizer`` in Hugging Face format (safetensors)."""
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)


# transformers 5 holds some families' weights in another layout than their checkpoints (a
# mixture-of-experts layer's experts fused into [E, ...] tensors, from one checkpoint tensor
# per expert and projection): ``from_pretrained`` converts on the way in, ``save_pretrained``
# converts back. A checkpoint written or read a tensor at a time (a sharded or expert-parallel
# policy, gathered one tensor at a time) goes through the same conversions here, so that its
# files are the ones ``save_pretrained`` writes whatever the layout that trained it.


def saved_pieces(model, pieces: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple]:
    """Each (name, tensor) of ``model``'s state as ``save_pretrained`` writes it (a fused
    experts tensor as its per-expert tensors), one of ``model``'s tensors at a time."""
    from transformers.core_model_loading import revert_weight_conversion

    for name, tensor in pieces:
        yield from revert_weight_conversion(model, {name: tensor}).items()


def loaded_pieces(model, pieces: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple]:
    """Checkpoint (name, tensor) pieces as ``save_pretrained`` writes them, as ``model``'s own
    tensors: the pieces a converted tensor of the model is saved as are put back together
    once all have come (how: ``saved_pieces`` of the tensor's element numbers says where each
    element goes); every other piece passes as it is, and so do the parts of a tensor that
    never completes (the caller's check of names reports them)."""
    from transformers.core_model_loading import revert_weight_conversion

    shapes = {name: tensor.shape for name, tensor in model.state_dict().items()}
    saved_as: dict[str, list[str]] = {}  # a converted tensor's name -> its pieces' names
    for name, shape in shapes.items():
        saved = list(revert_weight_conversion(model, {name: torch.empty(shape, device="meta")}))
        if saved != [name]:
            saved_as[name] = saved
    owner = {piece: name for name, saved in saved_as.items() for piece in saved}
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for piece, tensor in pieces:
        name = owner.get(piece)
        if name is None:
            yield piece, tensor
            continue
        parts = pending.setdefault(name, {})
        parts[piece] = tensor
        if len(parts) == len(saved_as[name]):
            del pending[name]
            yield name, _assembled(model, name, shapes[name], parts)
    for parts in pending.values():
        yield from parts.items()


def _assembled(model, name: str, shape, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """The tensor ``name`` of ``shape`` from the ``parts`` it is saved as."""
    from transformers.core_model_loading import revert_weight_conversion

    numbers = torch.arange(shape.numel()).view(shape)
    where = revert_weight_conversion(model, {name: numbers})
    first = next(iter(parts.values()))
    out = torch.empty(shape.numel(), dtype=first.dtype, device=first.device)
    for piece, tensor in parts.items():
        out[where[piece].reshape(-1).to(out.device)] = tensor.reshape(-1)
    return out.view(shape)


def apply_lora(model, rank: int, alpha: float, targets: list[str]):
    """Wrap ``model`` with LoRA adapters (PEFT): only the adapters train; the base is frozen."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ConfigError(
            "model.lora_rank > 0 needs PEFT: pip install peft (or pip install -e '.[lora]')"
        ) from None
    check_lora_targets(model, targets)
    config = LoraConfig(
        r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=list(targets), bias="none"
    )
    with peft_quietly():
        return get_peft_model(model, config)


def check_lora_targets(model, targets: list[str]) -> None:
    """Every name in ``targets`` is a module name of ``model`` whose modules are all linear or
    embedding layers, else a ``ConfigError`` listing the linear layers it has. A mixture-of-
    experts router is refused whatever its type: routing replay and the router statistics
    (``models.moe``) find and hook the router module itself, which an adapter would wrap and
    change; so are its experts, whose fused 3-D weights PEFT cannot adapt by module name."""
    from transformers.pytorch_utils import Conv1D  # GPT-2's linear layers

    from honing.models.moe import routers_of

    moe: dict[int, str] = {}
    routers = routers_of(model)
    for router, block in zip(routers.routers, routers.blocks, strict=True) if routers else ():
        moe[id(router)] = "a mixture-of-experts router"
        for module in router.modules():  # a router's own linear layer (DBRX's router.layer)
            moe.setdefault(id(module), "a mixture-of-experts router's layer")
        moe[id(block.experts)] = "mixture-of-experts experts held as fused 3-D weights"
    by_name: dict[str, list[torch.nn.Module]] = {}
    for name, module in model.named_modules():
        by_name.setdefault(name.rsplit(".", 1)[-1], []).append(module)
    linear = ", ".join(
        sorted(
            name
            for name, modules in by_name.items()
            if all(isinstance(m, (torch.nn.Linear, Conv1D)) and id(m) not in moe for m in modules)
        )
    )
    missing = [t for t in targets if t not in by_name]
    if missing:
        raise ConfigError(
            f"model.lora_target_modules: {missing} are not module names of this model; "
            f"its linear layers: {linear}"
        )
    for target in targets:
        for module in by_name[target]:
            kind = type(module).__name__
            if id(module) in moe:
                what = f"{moe[id(module)]} ({kind})"
            elif isinstance(module, (torch.nn.Linear, torch.nn.Embedding, Conv1D)):
                continue
            else:
                what = f"a {kind}"
            raise ConfigError(
                f"model.lora_target_modules: {target!r} names {what}, which LoRA does not "
                f"adapt here; choose among its linear layers: {linear}"
            )


@contextlib.contextmanager
def peft_quietly():
    """PEFT (0.21) reads transformers' deprecated ``is_gradient_checkpointing`` when it wraps a
    model, a FutureWarning on every LoRA run that the user can do nothing about; that warning
    is silenced, no other."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*is_gradient_checkpointing", FutureWarning)
        yield


def is_lora(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


def _adapted(base) -> list[tuple[str, torch.nn.Module]]:
    """The (name, module) pairs of ``base`` that PEFT wrapped with adapters."""
    return [
        (name, module)
        for name, module in base.named_modules()
        if hasattr(module, "get_delta_weight") and hasattr(module, "base_layer")
    ]


def check_mergeable(model) -> None:
    """Raises a ``ConfigError`` when ``model``'s adapters cannot be merged into a plain copy of
    it: an adapted weight tied to another (embeddings shared with the output head) would have
    to be both adapted and not."""
    if not is_lora(model):
        return
    base = model.get_base_model()
    names: dict[int, list[str]] = {}
    for name, param in base.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name.replace(".base_layer.", "."))
    for name, module in _adapted(base):
        tied = [n for n in names[id(module.base_layer.weight)] if n != f"{name}.weight"]
        if tied:
            raise ConfigError(
                f"model.lora_target_modules: {name.rsplit('.', 1)[-1]}'s weight is tied to "
                f"{tied[0]}, so merged adapters would change both; leave it out of the targets "
                "when the rollout engine runs in other processes (Ray workers, servers)"
            )


def plain_weight_items(model) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights a plain copy of ``model`` loads to compute what it computes, one (name,
    tensor) piece at a time: a LoRA model's adapters merged into their base weights (W +
    B·A·alpha/r, PEFT's own delta, for linear and embedding layers) under the base model's
    names, each merged matrix made only when its turn comes; ``model`` is not changed. Any
    other model: its state dict's tensors."""
    if not is_lora(model):
        yield from model.state_dict().items()
        return
    from honing.models.llama_block import adapted_weight

    check_mergeable(model)
    base = model.get_base_model()
    adapted = {f"{name}.base_layer.weight": layer for name, layer in _adapted(base)}
    for key, value in base.state_dict().items():
        if ".lora_" in key:
            continue
        if key in adapted:
            with torch.no_grad():
                value = adapted_weight(adapted[key])
        yield key.replace(".base_layer.", "."), value


def plain_weights(model) -> dict[str, torch.Tensor]:
    """``plain_weight_items`` as one mapping (every merged matrix at once)."""
    return dict(plain_weight_items(model))
