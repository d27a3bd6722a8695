"""What a checkpoint holds, and putting it back.

    checkpoints/step_<N>/
        config.json, model.safetensors, tokenizer files   the policy, Hugging Face format
        trainer_state.pt    each trainer engine's state (optimizer, schedule; the critic's
                            and the MTP heads' weights) by role, torch RNG states
        state.json          step, data cursor, seed (human-readable)
        config.yaml         the run's resolved config when this checkpoint was written
        COMPLETE            written last by CheckpointManager: only then is it loadable

Saving: a checkpoint whose weights are not all finite (a diverged run) is never written: the
save is refused with a ``checkpoint_refused`` event, so ``--resume auto``, rollbacks and
``honing checkpoints`` only ever see healthy weights. A refused save that was required (the
final one, an alert's stop) ends the run with one line naming the last good checkpoint.

A checkpoint that cannot be written (full disk) is reported by the manager as a
``checkpoint_failed`` event and leaves the previous checkpoints intact. The run then keeps
training and tries again at the next scheduled save (room may come back, and stopping would
lose the steps since the last checkpoint just the same), except when the save is required:
the final one, or one a caller needs before stopping. Then the run stops with one line
naming the directory and the free space (``UserError``, exit status 2, which the supervisor
does not restart: a full disk needs a person).

The step's sampling seed is derived from (seed, step), so restoring the cursor, weights,
optimizer and scheduler is enough for a resumed run to continue exactly as an uninterrupted
one. Without the optimizer (``checkpoint.save_optimizer=false``) the resume is not exact: Adam's
moments start again from zero.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from honing.checkpoint import CheckpointManager, CheckpointSaveError, verify
from honing.config import Config, dump_yaml
from honing.errors import UserError
from honing.models.loading import is_lora, save_model
from honing.pipeline.components import Components
from honing.pipeline.weight_sync import send_weights

TRAINER_STATE = "trainer_state.pt"
STATE_JSON = "state.json"
CONFIG_FILE = "config.yaml"


def save_training_state(
    manager: CheckpointManager,
    parts: Components,
    config: Config,
    step: int,
    required: bool | None = None,
    source_state: dict | None = None,
) -> Path | None:
    """Saves the whole training state as the checkpoint of ``step``.

    Args:
        required: Whether a failed save must stop the run; default: only the final step's.
        source_state: The data cursor to record, when prompts were drawn ahead of ``step``
            (asynchronous schedules); default: the source's own.

    Returns:
        The checkpoint directory, or ``None`` when a save that was not required failed
        (reported as a ``checkpoint_failed`` event; the next save tries again).

    Raises:
        UserError: A required save failed; the message names the directory and free space.
    """
    if required is None:
        required = step >= config.trainer.total_steps
    bad, checked = non_finite_tensors(parts)
    if bad:
        _refuse(manager, step, bad, checked, required)
        return None

    def write(directory: Path) -> None:
        save_model(parts.policy, parts.tokenizer, directory)
        trainers = {  # the policy's weights are the Hugging Face files above
            engine.role: engine.state(
                module=engine is not parts.trainers.policy,
                optimizer=config.checkpoint.save_optimizer,
            )
            for engine in parts.trainers.all()
        }
        state = {"trainers": trainers, "rng": torch.get_rng_state()}
        if torch.cuda.is_available():
            state["cuda_rng"] = torch.cuda.get_rng_state_all()
        torch.save(state, directory / TRAINER_STATE)
        info = {
            "step": step,
            "seed": config.trainer.seed,
            "data": source_state if source_state is not None else parts.source.state_dict(),
            "kl_coef": parts.kl_controller.value,  # moves under the adaptive controller
        }
        (directory / STATE_JSON).write_text(json.dumps(info, indent=1))
        (directory / CONFIG_FILE).write_text(dump_yaml(config))

    try:
        return manager.save(step, write)
    except CheckpointSaveError as err:
        if required:
            raise UserError(f"{err}; free some space, then resume with --resume auto") from None
        return None


def non_finite_tensors(parts: Components) -> tuple[list[str], int]:
    """Names of the trained parameters holding a NaN or an infinity (``role:name``), and the
    number of parameters checked; one pass over the weights, a host sync per module."""
    bad, checked = [], 0
    for engine in parts.trainers.all():
        named = list(engine.module.named_parameters())
        checked += len(named)
        finite = torch.stack([torch.isfinite(p).all() for _, p in named]).tolist()
        bad += [
            f"{engine.role}:{name}" for (name, _), ok in zip(named, finite, strict=True) if not ok
        ]
    return bad, checked


def _refuse(
    manager: CheckpointManager, step: int, bad: list[str], checked: int, required: bool
) -> None:
    """Records why the checkpoint of ``step`` was not written; raises when it was required."""
    reason = f"{len(bad)} of {checked} weight tensors hold NaN or infinity (first: {bad[0]})"
    manager.refuse(step, reason, non_finite=len(bad), tensors=checked)
    if required:
        good = manager.latest_good()
        raise UserError(
            f"the weights at step {step} are not finite: {reason}; no checkpoint was written. "
            + (
                f"The last good checkpoint is {good}: resume from it with --resume {good} "
                "and a smaller trainer.lr"
                if good
                else "No earlier checkpoint is good: start again with a smaller trainer.lr"
            )
        )


def _load_weights(parts: Components, checkpoint: Path) -> None:
    from safetensors.torch import load_file

    if is_lora(parts.policy):
        return _load_adapter(parts, checkpoint)
    weights = {}
    for shard in sorted(checkpoint.glob("*.safetensors")):
        weights.update(load_file(shard, device=str(parts.device)))
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


def load_training_state(parts: Components, checkpoint: Path) -> int:
    """Restore weights, optimizer, scheduler, RNG and data cursor; return the step.

    The checkpoint is verified against its manifest first, so a damaged one is refused
    (``UserError``) before any of it is loaded.
    """
    problem = verify(checkpoint)
    if problem is not None:
        raise UserError(f"checkpoint {checkpoint} is damaged ({problem}); resume from another")
    try:
        info = json.loads((checkpoint / STATE_JSON).read_text())
        state = torch.load(checkpoint / TRAINER_STATE, weights_only=True)
    except (OSError, ValueError, RuntimeError) as err:
        raise UserError(f"checkpoint {checkpoint} cannot be read ({err})") from None
    _load_weights(parts, checkpoint)
    states = trainer_states(state)
    for engine in parts.trainers.all():
        if engine.role in states:
            engine.load_state(states[engine.role])
        elif engine.role == "critic":
            raise UserError(
                f"checkpoint {checkpoint} has no critic; it was not trained with "
                "algorithm.advantage=gae"
            )  # (MTP heads missing from it start afresh, and learn)
    bad, _ = non_finite_tensors(parts)  # written by hand or by an older honing
    if bad:
        raise UserError(
            f"checkpoint {checkpoint} holds weights that are not finite ({len(bad)} tensors, "
            f"first: {bad[0]}); resume from an earlier one (honing checkpoints RUN_DIR)"
        )
    torch.set_rng_state(state["rng"])
    if "cuda_rng" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    parts.source.load_state_dict(info["data"])
    parts.kl_controller.value = info.get("kl_coef", parts.kl_controller.value)
    send_weights(parts, int(info["step"]))
    return int(info["step"])


def trainer_states(state: dict) -> dict[str, dict]:
    """The trainer engines' states by role from a ``trainer_state.pt``, also from one written
    before the states were kept by role (``scheduler``, ``optimizer``, ``critic``,
    ``critic_optimizer`` and ``mtp`` at the top)."""
    if "trainers" in state:
        return state["trainers"]
    policy = {"scheduler": state["scheduler"]}
    if "optimizer" in state:
        policy["optimizer"] = state["optimizer"]
    states = {"policy": policy}
    if "critic" in state:
        states["critic"] = {"module": state["critic"], "optimizer": state["critic_optimizer"]}
    if "mtp" in state:
        states["mtp"] = {"module": state["mtp"][0], "optimizer": state["mtp"][1]}
    return states
