"""Alert actions in real short runs: stop (checkpoint, exit status 3), rollback (reload the
last good checkpoint with a changed learning rate, continue), and the rollback limit.

The rules watch ``actor/lr`` under a linear warmup, a signal that crosses a threshold at a
known step, so each test knows exactly when its rule fires."""

import json

import pytest

from honing.backends.launch import train
from honing.cli import main
from honing.errors import RunStopped
from honing.pipeline.loop import TrainLoop
from tests.pipeline._configs import small_run_config

# warmup 10 steps to lr 1e-3: actor/lr is 1e-4 * step, so "actor/lr > 2.5e-4" fires at step 3
WARMUP = {"trainer.lr": 1e-3, "trainer.warmup_steps": 10, "checkpoint.every": 1}


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_rollback_reloads_the_last_good_checkpoint_and_continues(
    micro_model_dir, digit_reward, tmp_path
):
    rule = "actor/lr > 2.5e-4 -> rollback(lr_scale=0.1)"
    config = small_run_config(
        micro_model_dir,
        digit_reward,
        **WARMUP,
        **{"trainer.total_steps": 5, "monitor.alerts": [rule]},
    )
    train(config, tmp_path / "run", resume="never", log=lambda message: None)
    events = _lines(tmp_path / "run" / "events.jsonl")
    [alert] = [e for e in events if e["kind"] == "alert"]
    [rollback] = [e for e in events if e["kind"] == "rollback"]
    assert (alert["step"], alert["good_step"]) == (3, 2)
    assert (rollback["step"], rollback["to_step"], rollback["changes"]) == (3, 2, {"lr_scale": 0.1})
    metrics = _lines(tmp_path / "run" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1, 2, 3, 4, 5]  # step 3 redone, logged once
    lrs = {m["step"]: m["actor/lr"] for m in metrics if "actor/lr" in m}
    assert lrs[2] == 2e-4 and abs(lrs[3] - 3e-5) < 1e-12 and abs(lrs[5] - 5e-5) < 1e-12
    checkpoints = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step_*"))
    assert "step_5" in checkpoints


def test_stop_writes_a_checkpoint_and_exits_with_status_3(
    micro_model_dir, digit_reward, tmp_path, capsys
):
    out = tmp_path / "run"
    status = main(
        [
            "train",
            f"model.path={micro_model_dir}",
            f"reward.function={digit_reward}",
            "trainer.total_steps=6",
            "trainer.lr=1e-3",
            "trainer.warmup_steps=10",
            "checkpoint.every=0",
            "rollout.batch_size=2",
            "rollout.group_size=3",
            "rollout.max_new_tokens=3",
            "rollout.val_samples=1",
            "data.train_size=40",
            "data.val_size=4",
            "trainer.val_every=0",
            "monitor.console=false",
            "monitor.tensorboard=false",
            "monitor.alerts=['actor/lr > 2.5e-4 -> stop']",
            "--output-dir",
            str(out),
        ]
    )
    assert status == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("honing: stopped by alert 'actor/lr > 2.5e-4 -> stop' at step 3")
    assert (out / "checkpoints" / "step_3" / "COMPLETE").is_file()
    assert [e["kind"] for e in _lines(out / "events.jsonl")][-2:] == ["alert", "stopped"]


def test_rollback_without_a_good_checkpoint_stops(micro_model_dir, digit_reward, tmp_path):
    config = small_run_config(
        micro_model_dir,
        digit_reward,
        **WARMUP
        | {
            "trainer.total_steps": 4,
            "checkpoint.every": 0,
            "monitor.alerts": ["actor/lr > 0 -> rollback"],
        },
    )
    with pytest.raises(RunStopped, match="at step 1;"):
        train(config, tmp_path / "run", resume="never", log=lambda message: None)
    kinds = [e["kind"] for e in _lines(tmp_path / "run" / "events.jsonl")]
    assert kinds[-3:] == ["alert", "rollback_refused", "stopped"]


def test_rollbacks_are_bounded(micro_model_dir, digit_reward, tmp_path):
    config = small_run_config(
        micro_model_dir,
        digit_reward,
        **WARMUP,
        **{
            "trainer.total_steps": 6,
            "monitor.max_rollbacks": 2,
            "monitor.alerts": ["actor/lr > 2.5e-4 -> rollback"],  # no lr change: fires again
        },
    )
    with pytest.raises(RunStopped):
        train(config, tmp_path / "run", resume="never", log=lambda message: None)
    events = _lines(tmp_path / "run" / "events.jsonl")
    acts = ("rollback", "rollback_refused", "stopped")
    assert [e["kind"] for e in events if e["kind"] in acts] == [
        "rollback",
        "rollback",
        "rollback_refused",
        "stopped",
    ]
    assert "max_rollbacks=2" in events[-2]["reason"]


def test_two_rollbacks_halve_the_learning_rate_twice_and_a_resume_keeps_it(
    micro_model_dir, digit_reward, tmp_path, monkeypatch
):
    # warmup 3 steps to 1e-4: lr rises at step 2 (rollback to 1, lr x 0.5), then, the history
    # cleared, at step 3 (rollback to 2, whose checkpoint already carries the first halving)
    rule = "actor/lr rises 1 -> rollback(lr_scale=0.5, temperature=0.8)"
    overrides = {
        "trainer.lr": 1e-4,
        "trainer.warmup_steps": 3,
        "trainer.total_steps": 6,
        "checkpoint.every": 1,
        "checkpoint.keep": 10,
        "monitor.max_rollbacks": 2,
        "monitor.alerts": [rule],
    }
    run = tmp_path / "run"
    config = small_run_config(micro_model_dir, digit_reward, **overrides)
    train(config, run, resume="never", log=lambda message: None)
    events = _lines(run / "events.jsonl")
    rollbacks = [(e["step"], e["to_step"]) for e in events if e["kind"] == "rollback"]
    assert rollbacks == [(2, 1), (3, 2)]
    lrs = {m["step"]: m["actor/lr"] for m in _lines(run / "metrics.jsonl") if m["step"]}
    quarter = 0.25 * 1e-4  # two halvings
    assert lrs[1] == pytest.approx(1e-4 / 3, rel=1e-12)
    assert lrs[2] == pytest.approx(0.5 * 2e-4 / 3, rel=1e-12)  # redone after the first
    for step in (3, 4, 5, 6):
        assert lrs[step] == pytest.approx(quarter, rel=1e-12)

    saved = json.loads((run / "checkpoints" / "step_6" / "state.json").read_text())
    assert saved["adjusted"] == {"temperature": 0.8}

    # A resume continues with the rollbacks' learning rate and temperature, as the run would
    # have gone on.
    temperatures = []
    run_loop = TrainLoop.run

    def watched(loop, start):
        settings = loop.parts.update_settings
        temperatures.append((loop.parts.train_sampling.temperature, settings.temperature))
        return run_loop(loop, start)

    monkeypatch.setattr(TrainLoop, "run", watched)
    more = small_run_config(micro_model_dir, digit_reward, **overrides | {"trainer.total_steps": 7})
    train(more, run, resume="auto", log=lambda message: None)
    lrs = {m["step"]: m["actor/lr"] for m in _lines(run / "metrics.jsonl") if m["step"]}
    assert lrs[7] == pytest.approx(quarter, rel=1e-12)
    assert temperatures == [(0.8, 0.8)]
