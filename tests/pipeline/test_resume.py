"""A run interrupted after a checkpoint and resumed ends exactly where an uninterrupted one does.

Also: what a run directory holds, complete checkpoints that load as Hugging Face models, and
checkpoint retention.
"""

import json
import shutil
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM

from honing.backends.launch import train
from honing.config import build_config, load_yaml

NO_LOG = lambda message: None  # noqa: E731 - keeps the test output quiet


def micro_config(model_dir, reward, **overrides):
    values = {
        "model.path": str(model_dir),
        "reward.function": reward,
        "trainer.total_steps": 6,
        "trainer.seed": 3,
        "trainer.lr": 1e-3,
        # Warmup makes the learning rate depend on the step, so a resumed run that failed to
        # restore its scheduler would train differently. (Not a decay: its shape would depend
        # on total_steps, which differs between the interrupted run and the full one.)
        "trainer.warmup_steps": 5,
        "trainer.val_every": 0,
        "rollout.batch_size": 4,
        "rollout.group_size": 4,
        "rollout.max_new_tokens": 4,
        "rollout.val_samples": 2,
        "data.train_size": 200,
        "data.val_size": 16,
        "checkpoint.every": 3,
        "monitor.console": False,
        "monitor.tensorboard": False,
    }
    return build_config(values | overrides)


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def checkpoint_weights(run_dir, step):
    model = AutoModelForCausalLM.from_pretrained(run_dir / "checkpoints" / f"step_{step}")
    return model.state_dict()


@pytest.fixture(scope="module")
def runs(micro_model_dir, digit_reward, tmp_path_factory):
    """Run A: 6 steps at once. Run B: interrupted during step 5, then resumed with auto.

    The interrupted run trains 4 steps (checkpoints at 3 and 4); deleting ``step_4`` leaves
    what a crash after step 4 was logged but before its checkpoint was published leaves: a
    checkpoint at 3 and logs up to 4. The resumed run must redo step 4 and log it once.
    """
    dir_a = tmp_path_factory.mktemp("run_a")
    dir_b = tmp_path_factory.mktemp("run_b")
    train(micro_config(micro_model_dir, digit_reward), dir_a, log=NO_LOG)
    interrupted = micro_config(micro_model_dir, digit_reward, **{"trainer.total_steps": 4})
    first_b = train(interrupted, dir_b, log=NO_LOG)
    shutil.rmtree(dir_b / "checkpoints" / "step_4")
    second_b = train(micro_config(micro_model_dir, digit_reward), dir_b, resume="auto", log=NO_LOG)
    return dir_a, dir_b, first_b, second_b


def test_summary_of_a_resumed_run_covers_the_whole_run(runs):
    dir_a, _, first_b, second_b = runs
    assert (first_b["first_step"], first_b["last_step"]) == (0, 4)
    # The resumed run reports from the run's true start (step 0), not from the resume point.
    assert (second_b["first_step"], second_b["last_step"]) == (0, 6)
    summary_a = json.loads((dir_a / "summary.json").read_text())
    assert second_b["val_accuracy_start"] == summary_a["val_accuracy_start"]
    assert second_b["val_accuracy_end"] == summary_a["val_accuracy_end"]


def test_resumed_run_ends_with_the_same_weights(runs, micro_model_dir):
    dir_a, dir_b, _, _ = runs
    weights_a, weights_b = checkpoint_weights(dir_a, 6), checkpoint_weights(dir_b, 6)
    assert weights_a.keys() == weights_b.keys()
    for name in weights_a:
        assert torch.equal(weights_a[name], weights_b[name]), name
    # ... and training did change them (so equality is not the trivial "nothing happened").
    start = AutoModelForCausalLM.from_pretrained(micro_model_dir).state_dict()
    assert any(not torch.equal(start[k], weights_a[k]) for k in weights_a)


def test_resumed_run_logs_each_step_once_with_the_same_values(runs):
    dir_a, dir_b, _, _ = runs
    metrics_a = read_jsonl(dir_a / "metrics.jsonl")
    metrics_b = read_jsonl(dir_b / "metrics.jsonl")
    # Step 0 is the validation before training; then one line per training step.
    assert [m["step"] for m in metrics_a] == [0, 1, 2, 3, 4, 5, 6]
    assert [m["step"] for m in metrics_b] == [0, 1, 2, 3, 4, 5, 6]
    assert any(m["critic/score/mean"] > 0 for m in metrics_a[1:])  # there is a signal
    for a, b in zip(metrics_a[1:], metrics_b[1:], strict=True):
        assert a["critic/score/mean"] == b["critic/score/mean"], a["step"]
        assert a["actor/pg_loss"] == b["actor/pg_loss"], a["step"]
        assert a["actor/lr"] == b["actor/lr"], a["step"]
    assert metrics_a[-1]["val/accuracy"] == metrics_b[-1]["val/accuracy"]
    steps_a = [s["step"] for s in read_jsonl(dir_a / "samples.jsonl")]
    steps_b = [s["step"] for s in read_jsonl(dir_b / "samples.jsonl")]
    assert steps_b == steps_a
    assert sorted(set(steps_b)) == [1, 2, 3, 4, 5, 6]


def test_resume_is_recorded_as_an_event(runs):
    _, dir_b, _, _ = runs
    events = [e for e in read_jsonl(dir_b / "events.jsonl") if e["kind"] == "resumed"]
    assert len(events) == 1
    assert events[0]["step"] == 3
    assert events[0]["checkpoint"].endswith("step_3")
    assert events[0]["dropped"] == {"metrics.jsonl": 1, "samples.jsonl": 4}  # step 4's lines


def test_run_directory_layout_and_retention(micro_model_dir, digit_reward, tmp_path):
    config = micro_config(
        micro_model_dir,
        digit_reward,
        **{
            "trainer.total_steps": 3,
            "trainer.val_at_start": False,
            "checkpoint.every": 1,
            "checkpoint.keep": 2,
            "monitor.tensorboard": True,
        },
    )
    run_dir = tmp_path / "run"
    train(config, run_dir, log=NO_LOG)
    for name in ("config.yaml", "metrics.jsonl", "samples.jsonl", "events.jsonl", "summary.json"):
        assert (run_dir / name).is_file(), name
    assert any((run_dir / "tensorboard").iterdir())
    # The resolved config is written in full and reproduces the run's config, with the engine
    # rollout.engine=auto chose (honing's own, for this model) in place of auto.
    chosen = replace(config, rollout=replace(config.rollout, engine="transformers"))
    assert build_config(load_yaml(run_dir / "config.yaml")) == chosen
    # keep=2: of the checkpoints at steps 1, 2 and 3 only the newest two remain.
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert checkpoints == ["step_2", "step_3"]
    for name in checkpoints:
        path = run_dir / "checkpoints" / name
        assert (path / "COMPLETE").is_file()
        assert json.loads((path / "state.json").read_text())["step"] == int(name[5:])
        model = AutoModelForCausalLM.from_pretrained(path)
        assert model.config.vocab_size == 99
