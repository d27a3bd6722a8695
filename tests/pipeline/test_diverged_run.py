"""A run whose weights stop being finite never writes them as a checkpoint.

``trainer.lr=1e39`` is a finite config value, but in float32 the first AdamW step makes every
weight infinite or NaN (later updates are then skipped for their non-finite gradients): the
run a careless setting diverges.
"""

import json

import pytest
import torch

from honing.backends.launch import train
from honing.checkpoint import CheckpointManager
from honing.checkpoint.versions import format_checkpoints, list_checkpoints
from honing.errors import UserError
from honing.pipeline.components import build_components
from honing.pipeline.state import load_training_state, non_finite_tensors, save_training_state

from ._configs import small_run_config

NO_LOG = lambda message: None  # noqa: E731
DIVERGING = {"trainer.lr": 1e39, "monitor.alerts": []}


def _config(model_dir, reward, **overrides):
    settings = {"trainer.total_steps": 3, "checkpoint.every": 1, "checkpoint.keep": 10}
    return small_run_config(model_dir, reward, **settings | overrides)


def _events(run_dir, kind):
    lines = (run_dir / "events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["kind"] == kind]


def test_no_checkpoint_of_non_finite_weights_is_written(tmp_path, micro_model_dir, digit_reward):
    run = tmp_path / "run"
    config = _config(micro_model_dir, digit_reward, **DIVERGING)
    with pytest.raises(UserError, match=r"^the weights at step 3 are not finite: .* no checkpoint"):
        train(config, run, log=NO_LOG)  # the final save is required: the run says why it ended
    refused = _events(run, "checkpoint_refused")
    assert [e["step"] for e in refused] == [1, 2, 3]
    assert refused[0]["non_finite"] > 0 and "NaN or infinity" in refused[0]["reason"]
    assert CheckpointManager(run / "checkpoints", keep=10).complete_steps() == []
    assert list_checkpoints(run) == []
    assert "no checkpoints" in format_checkpoints(list_checkpoints(run))


def test_the_last_good_checkpoint_stays_what_resume_auto_takes(
    tmp_path, micro_model_dir, digit_reward
):
    run = tmp_path / "run"
    config = _config(micro_model_dir, digit_reward, **{"trainer.total_steps": 2})
    train(config, run, log=NO_LOG)
    events = []
    manager = CheckpointManager(
        run / "checkpoints", keep=10, on_event=lambda k, **f: events.append(k)
    )
    parts = build_components(config, log=NO_LOG)
    load_training_state(parts, manager.path_for(2))
    with torch.no_grad():
        next(parts.policy.parameters())[0, 0] = float("inf")  # the weights of a later step
    assert save_training_state(manager, parts, config, 3, required=False) is None
    with pytest.raises(UserError, match=r"The last good checkpoint is .*step_2: resume from it"):
        save_training_state(manager, parts, config, 4, required=True)
    assert events.count("checkpoint_refused") == 2
    rows = list_checkpoints(run)
    assert [(r["step"], r["ok"], r["last_good"]) for r in rows] == [
        (1, True, False),
        (2, True, True),
    ]
    assert manager.resolve("auto").name == "step_2"


def test_a_checkpoint_holding_non_finite_weights_is_not_loaded(
    tmp_path, micro_model_dir, digit_reward
):
    """One written by hand or by another tool: its manifest verifies, its weights do not."""
    from safetensors.torch import load_file, save_file

    from honing.checkpoint.manifest import write_manifest

    run = tmp_path / "run"
    config = _config(micro_model_dir, digit_reward, **{"trainer.total_steps": 1})
    train(config, run, log=NO_LOG)
    step = run / "checkpoints" / "step_1"
    weights = load_file(step / "model.safetensors")
    name = next(iter(weights))
    weights[name] = torch.full_like(weights[name], float("nan"))
    save_file(weights, step / "model.safetensors", metadata={"format": "pt"})
    write_manifest(step)
    parts = build_components(config, log=NO_LOG)
    assert non_finite_tensors(parts)[0] == []
    with pytest.raises(UserError, match=rf"holds weights that are not finite .*{name}"):
        load_training_state(parts, step)
