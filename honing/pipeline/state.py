"""What a checkpoint holds, and putting it back.

    checkpoints/step_<N>/
        config.json, model.safetensors, tokenizer files   the policy, Hugging Face format
        trainer_state.pt    optimizer, scheduler, torch RNG state
        state.json          step, data cursor, seed (human-readable)
        COMPLETE            written last by CheckpointManager: only then is it loadable

The step's sampling seed is derived from (seed, step), so restoring the cursor, weights and
optimizer is enough for a resumed run to continue exactly as an uninterrupted one.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from honing.checkpoint import CheckpointManager
from honing.models.loading import save_model
from honing.pipeline.components import Components

TRAINER_STATE = "trainer_state.pt"
STATE_JSON = "state.json"


def save_training_state(
    manager: CheckpointManager, parts: Components, step: int, *, seed: int, save_optimizer: bool
) -> Path:
    def write(directory: Path) -> None:
        save_model(parts.policy, parts.tokenizer, directory)
        state = {"scheduler": parts.scheduler.state_dict(), "rng": torch.get_rng_state()}
        if save_optimizer:
            state["optimizer"] = parts.optimizer.state_dict()
        torch.save(state, directory / TRAINER_STATE)
        info = {"step": step, "seed": seed, "data": parts.source.state_dict()}
        (directory / STATE_JSON).write_text(json.dumps(info, indent=1))

    return manager.save(step, write)


def load_training_state(parts: Components, checkpoint: Path) -> int:
    """Restore weights, optimizer, scheduler, RNG and data cursor; return the step."""
    from safetensors.torch import load_file

    info = json.loads((checkpoint / STATE_JSON).read_text())
    weights = {}
    for shard in sorted(checkpoint.glob("*.safetensors")):
        weights.update(load_file(shard, device=str(parts.device)))
    missing, unexpected = parts.policy.load_state_dict(weights, strict=False)
    # Tied embeddings are saved once; anything else missing means the wrong checkpoint.
    missing = [k for k in missing if "lm_head" not in k]
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {checkpoint} does not match the model: "
            f"missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    if getattr(parts.policy.config, "tie_word_embeddings", False):
        parts.policy.tie_weights()
    state = torch.load(checkpoint / TRAINER_STATE, weights_only=False)
    parts.scheduler.load_state_dict(state["scheduler"])
    if "optimizer" in state:
        parts.optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"])
    parts.source.load_state_dict(info["data"])
    parts.engine.load_weights(info["step"])
    return int(info["step"])
