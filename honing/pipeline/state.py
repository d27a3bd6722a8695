"""What a checkpoint holds, and putting it back.

    checkpoints/step_<N>/
        config.json, model*.safetensors, tokenizer files   the policy, Hugging Face format
        trainer_state.pt    each trainer engine's state (optimizer, schedule; the critic's
                            and the MTP heads' weights) by role, torch RNG states
        trainer/            sharded modules: each rank's shards (``checkpoint_files``)
        state.json          step, data cursor, seed (human-readable)
        config.yaml         the run's resolved config when this checkpoint was written
        COMPLETE            written last by CheckpointManager: only then is it loadable

Under a sharded layout every rank takes part in a save and a load (``peers``: rank 0's
``save`` and ``load`` ops; the others run ``save_part`` and ``load_part``): each writes and
reads its own shards, rank 0 the files of the whole.

Saving: a checkpoint whose weights are not all finite (a diverged run) is never written: the
save is refused with a ``checkpoint_refused`` event, so ``--resume auto``, rollbacks and
``honing checkpoints`` only ever see healthy weights. A refused save that was required (the
final one, an alert's stop) ends the run with one line naming the last good checkpoint.

A checkpoint that cannot be written (full disk) is reported by the manager as a
``checkpoint_failed`` event and leaves the previous checkpoints intact. The run then keeps
training and tries again at the next scheduled save (room may come back, and stopping would
lose the steps since the last checkpoint just the same), except when the save is required:
the final one, or one a caller needs before stopping. Then the run stops with one line
naming the directory, the free space and what a checkpoint needs (``UserError``, exit status
2, which the supervisor does not restart: a full disk needs a person).

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
from honing.models.loading import is_lora
from honing.pipeline.checkpoint_files import (
    TRAINER_STATE,
    load_engine_states,
    load_policy,
    write_policy,
    write_trainer_state,
)
from honing.pipeline.components import Components
from honing.pipeline.peers import Alone, Op, Peers
from honing.pipeline.weight_sync import send_weights
from honing.trainer.sharded import local_bytes

STATE_JSON = "state.json"
CONFIG_FILE = "config.yaml"


def save_training_state(
    manager: CheckpointManager,
    parts: Components,
    config: Config,
    step: int,
    required: bool | None = None,
    source_state: dict | None = None,
    peers: Peers | None = None,
    adjusted: dict[str, float] | None = None,
) -> Path | None:
    """Saves the whole training state as the checkpoint of ``step``.

    Args:
        required: Whether a failed save must stop the run; default: only the final step's.
        source_state: The data cursor to record, when prompts were drawn ahead of ``step``
            (asynchronous schedules); default: the source's own.
        peers: the run's other processes (they write their shards of a sharded layout).
        adjusted: the alert rollbacks' sampling and loss settings in force (``temperature``,
            ``kl_coef``), which a resume keeps (``adjustments``); the learning-rate scale is
            kept with the policy's schedule.

    Returns:
        The checkpoint directory, or ``None`` when a save that was not required failed
        (reported as a ``checkpoint_failed`` event; the next save tries again).

    Raises:
        UserError: A required save failed; the message names the directory, the free space
            and what a checkpoint needs.
    """
    peers = peers or Alone()
    if required is None:
        required = step >= config.trainer.total_steps
    with peers.together(Op.SAVE, step):
        bad, checked = non_finite_tensors(parts)
        if bad:
            _refuse(manager, step, bad, checked, required)
            return None
        told = []

        def write(directory: Path) -> None:
            peers.tell(str(directory))  # where the others write their shards
            told.append(directory)
            write_policy(parts, directory, writer=True)
            write_trainer_state(parts, config, directory, writer=True)
            info = {
                "step": step,
                "seed": config.trainer.seed,
                "data": source_state if source_state is not None else parts.source.state_dict(),
                "kl_coef": parts.kl_controller.value,  # moves under the adaptive controller
                "adjusted": adjusted or {},
            }
            (directory / STATE_JSON).write_text(json.dumps(info, indent=1))
            (directory / CONFIG_FILE).write_text(dump_yaml(config))

        try:
            size = lambda: checkpoint_bytes(parts, config)  # noqa: E731 - asked on a failure
            return manager.save(step, write, expected_bytes=size)
        except CheckpointSaveError as err:
            if required:
                raise UserError(f"{err}; free some space, then resume with --resume auto") from None
            return None
        finally:
            if not told:  # the save failed before writing: the others stop waiting
                peers.tell(None)


def checkpoint_bytes(parts: Components, config: Config) -> int:
    """About what a checkpoint of ``parts`` takes on this process: the trained modules'
    parameters (a LoRA policy's adapters only) and, when the optimizer is saved, AdamW's two
    fp32 moments of each trained one (this rank's shards of them when sharded). For the
    message of a save that finds no room."""
    from torch.distributed.tensor import DTensor

    total = 0
    for trainer in parts.trainers.all():
        params = list(trainer.module.parameters())
        trained = [p for p in params if p.requires_grad]
        saved = trained if trainer is parts.trainers.policy and is_lora(trainer.module) else params
        total += local_bytes(saved)
        if config.checkpoint.save_optimizer:
            local = (p.to_local() if isinstance(p, DTensor) else p for p in trained)
            total += 2 * 4 * sum(p.numel() for p in local)
    return total


def save_part(parts: Components, config: Config, receive) -> None:
    """A rank other than 0 in a save of a sharded run: the same health check, then its
    shards into the directory rank 0 names (``receive()``; None: no save)."""
    bad, _ = non_finite_tensors(parts)
    if bad:
        return
    directory = receive()
    if directory is not None:
        write_policy(parts, Path(directory), writer=False)
        write_trainer_state(parts, config, Path(directory), writer=False)


def non_finite_tensors(parts: Components) -> tuple[list[str], int]:
    """Names of the trained parameters holding a NaN or an infinity (``role:name``), and the
    number of parameters checked; one pass over the weights, a host sync per module. Under a
    sharded layout each rank checks its shards and the count is every rank's."""
    from torch.distributed.tensor import DTensor

    bad, checked = [], 0
    for trainer in parts.trainers.all():
        named = [
            (name, p.to_local() if isinstance(p, DTensor) else p)
            for name, p in trainer.module.named_parameters()
        ]
        checked += len(named)
        finite = torch.stack([torch.isfinite(p).all() for _, p in named]).tolist()
        bad += [
            f"{trainer.role}:{name}" for (name, _), ok in zip(named, finite, strict=True) if not ok
        ]
    policy = parts.trainers.policy
    if policy.is_sharded:  # every rank's shards: the count is all of theirs
        total = int(policy.reduce({"bad": torch.tensor(len(bad))})["bad"])
        bad = ((bad or ["a shard held by another rank"]) * total)[:total]
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


def load_training_state(parts: Components, checkpoint: Path, peers: Peers | None = None) -> int:
    """Restore weights, optimizer, scheduler, RNG and data cursor; return the step.

    The checkpoint is verified against its manifest first, so a damaged one is refused
    (``UserError``) before any of it is loaded. ``peers``: the run's other processes (they
    read their shards of a sharded layout, and get the new weights).
    """
    peers = peers or Alone()
    problem = verify(checkpoint)
    if problem is not None:
        raise UserError(f"checkpoint {checkpoint} is damaged ({problem}); resume from another")
    try:
        info = json.loads((checkpoint / STATE_JSON).read_text())
        state = torch.load(checkpoint / TRAINER_STATE, weights_only=True)
    except (OSError, ValueError, RuntimeError) as err:
        raise UserError(f"checkpoint {checkpoint} cannot be read ({err})") from None
    with peers.together(Op.LOAD, str(checkpoint)):
        load_engines(parts, checkpoint, state)
    torch.set_rng_state(state["rng"])
    if "cuda_rng" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    parts.source.load_state_dict(info["data"])
    parts.kl_controller.value = info.get("kl_coef", parts.kl_controller.value)
    step = int(info["step"])
    with peers.together(Op.SYNC, step):
        send_weights(parts, step)
    return step


def adjustments(checkpoint: Path) -> dict[str, float]:
    """The alert rollbacks' settings in force when ``checkpoint`` was saved (``adjusted``)."""
    return json.loads((checkpoint / STATE_JSON).read_text()).get("adjusted", {})


def load_engines(parts: Components, checkpoint: Path, state: dict) -> None:
    """The policy's weights and every trainer engine's state from ``checkpoint`` (whose
    ``trainer_state.pt`` is ``state``); every rank of a sharded run runs it."""
    load_policy(parts, checkpoint)
    states = load_engine_states(parts, checkpoint, state)
    for trainer in parts.trainers.all():
        if trainer.role in states:
            trainer.load_state(states[trainer.role])
        elif trainer.role == "critic":
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


def load_part(parts: Components, checkpoint: str) -> None:
    """A rank other than 0 in a load of a sharded run: its shards of ``checkpoint``."""
    path = Path(checkpoint)
    load_engines(parts, path, torch.load(path / TRAINER_STATE, weights_only=True))
