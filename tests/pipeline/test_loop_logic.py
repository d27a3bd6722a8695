"""The loop's logic on a bigram policy (``fakes``): schedules, accounting, resume, alerts and
rollback through the real pipeline, in milliseconds a step. What needs a real transformer
(its numerics, the lean paths, engines, backends) is tested elsewhere with the micro Llama."""

import json

import pytest
import torch
from safetensors.torch import load_file

from honing.config import build_config
from honing.errors import ConfigError, RunStopped
from honing.pipeline import evaluate
from honing.pipeline.rules import check_config
from honing.pipeline.run import train_here

from .fakes import fake_components

NO_LOG = lambda message: None  # noqa: E731


@pytest.fixture(autouse=True)
def no_rescoring_waits(monkeypatch):
    """Validation's pauses before it scores a failure again (tested with a service in
    tests/services/test_validation_scores.py) would be most of these runs' time."""
    monkeypatch.setattr(evaluate, "RESCORE_WAITS_S", (0.0, 0.0))


ACCOUNTED = ("samples/trained", "samples/filtered", "samples/failed", "samples/stale")


def config(reward, **overrides):
    values = {
        "model.path": "unused",
        "reward.function": reward,
        "rollout.batch_size": 2,
        "rollout.group_size": 3,
        "rollout.max_new_tokens": 4,
        "rollout.val_samples": 2,
        "data.train_size": 40,
        "data.val_size": 6,
        "trainer.total_steps": 6,
        "trainer.lr": 0.3,
        "trainer.val_every": 3,
        "checkpoint.every": 2,
        "checkpoint.keep": 10,
        "monitor.console": False,
        "monitor.tensorboard": False,
        "monitor.system_metrics": False,
    }
    built = build_config(values | overrides)
    check_config(built)
    return built


def run(cfg, run_dir, resume="auto"):
    return train_here(cfg, run_dir, resume, log=NO_LOG, build=fake_components)


def steps(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [m for m in map(json.loads, lines) if m["step"] >= 1]


def events(run_dir, kind):
    lines = (run_dir / "events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["kind"] == kind]


def weights(run_dir, step):
    return load_file(run_dir / "checkpoints" / f"step_{step}" / "model.safetensors")


@pytest.mark.parametrize("mode", ["sync", "one_step", "async"])
def test_every_sample_is_accounted_for_under_each_schedule(tmp_path, digit_reward, mode):
    cfg = config(digit_reward, **{"schedule.mode": mode})
    summary = run(cfg, tmp_path / "run")
    trained = steps(tmp_path / "run")
    assert [m["step"] for m in trained] == [1, 2, 3, 4, 5, 6]
    for m in trained:
        assert m["samples/generated"] == 6 == sum(m[k] for k in ACCOUNTED)
        assert m["samples/trained"] == 6
    if mode == "one_step":  # step k trains on samples of version k - 2 (0 for the first)
        assert [m["async/weight_version"] for m in trained] == [0, 0, 1, 2, 3, 4]
    if mode == "async":
        assert all(0 <= m["async/staleness"] <= 1 for m in trained)
    assert summary["first_step"] == 0 and summary["last_step"] == 6


def test_training_moves_the_policy_toward_the_reward(tmp_path, digit_reward):
    cfg = config(digit_reward, **{"trainer.total_steps": 30, "checkpoint.every": 0})
    run(cfg, tmp_path / "run")
    scores = [m["critic/score/mean"] for m in steps(tmp_path / "run")]
    assert sum(scores[-5:]) / 5 > sum(scores[:5]) / 5 + 0.1  # digits are rewarded


def test_one_step_is_deterministic_and_sync_differs(tmp_path, digit_reward):
    first = config(digit_reward, **{"schedule.mode": "one_step"})
    run(first, tmp_path / "a")
    run(first, tmp_path / "b")
    run(config(digit_reward), tmp_path / "sync")
    key = "critic/score/mean"
    a, b = ([m[key] for m in steps(tmp_path / name)] for name in ("a", "b"))
    assert a == b
    assert a != [m[key] for m in steps(tmp_path / "sync")]


def test_a_resumed_run_ends_where_an_uninterrupted_one_does(tmp_path, digit_reward):
    whole = config(digit_reward)
    run(whole, tmp_path / "whole")
    run(config(digit_reward, **{"trainer.total_steps": 4}), tmp_path / "cut")
    run(whole, tmp_path / "cut")  # --resume auto from step 4
    assert events(tmp_path / "cut", "resumed")[0]["step"] == 4
    for name, tensor in weights(tmp_path / "whole", 6).items():
        assert torch.equal(tensor, weights(tmp_path / "cut", 6)[name]), name
    key = "critic/score/mean"
    assert [m[key] for m in steps(tmp_path / "cut")] == [m[key] for m in steps(tmp_path / "whole")]


def test_one_step_resumes_sampling_with_the_checkpoints_version(tmp_path, digit_reward):
    """A checkpoint holds one version: after a resume from step 4, step 5 samples with
    version 4 (an uninterrupted run used 3), then the schedule is as before."""
    whole = config(digit_reward, **{"schedule.mode": "one_step"})
    run(
        config(digit_reward, **{"schedule.mode": "one_step", "trainer.total_steps": 4}),
        tmp_path / "cut",
    )
    run(whole, tmp_path / "cut")
    versions = [m["async/weight_version"] for m in steps(tmp_path / "cut")]
    assert versions == [0, 0, 1, 2, 4, 4]
    assert all(m["samples/trained"] == 6 for m in steps(tmp_path / "cut"))


def test_a_stop_rule_checkpoints_and_stops_with_status_3(tmp_path, digit_reward):
    cfg = config(digit_reward, **{"monitor.alerts": ["critic/score/mean > -1 for 2 steps -> stop"]})
    with pytest.raises(RunStopped, match="at step 2") as stopped:
        run(cfg, tmp_path / "run")
    assert stopped.value.exit_status == 3
    assert (tmp_path / "run" / "checkpoints" / "step_2" / "COMPLETE").is_file()
    assert events(tmp_path / "run", "stopped")[0]["step"] == 2


def test_a_rollback_without_a_checkpoint_before_it_becomes_a_stop(tmp_path, digit_reward):
    rule = "actor/lr > 0.2 -> rollback(lr_scale=0.5)"  # fires at step 1: nothing to go back to
    with pytest.raises(RunStopped, match="at step 1"):
        run(config(digit_reward, **{"monitor.alerts": [rule]}), tmp_path / "run")
    [refused] = events(tmp_path / "run", "rollback_refused")
    assert "no good checkpoint at or before step 0" in refused["reason"]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_rollback_redoes_the_steps_from_the_checkpoint_with_the_lr_scaled(
    tmp_path, digit_reward, mode
):
    # Warm-up raises the lr to 0.3 over 6 steps: past 0.2 at step 5 (0.25), after the
    # checkpoint of step 4; the steps redone from there run at half the scheduled lr.
    rule = "actor/lr > 0.2 -> rollback(lr_scale=0.5)"
    overrides = {"monitor.alerts": [rule], "trainer.warmup_steps": 6, "schedule.mode": mode}
    run(config(digit_reward, **overrides), tmp_path / "run")
    [rollback] = events(tmp_path / "run", "rollback")
    assert (rollback["step"], rollback["to_step"], rollback["dropped"]["metrics.jsonl"]) == (
        5,
        4,
        1,
    )
    lrs = {m["step"]: m["actor/lr"] for m in steps(tmp_path / "run")}
    assert list(lrs) == [1, 2, 3, 4, 5, 6]  # step 5 logged once: the redone one
    assert lrs[4] == pytest.approx(0.2) and lrs[5] == pytest.approx(0.125)
    assert lrs[6] == pytest.approx(0.15)


def test_dynamic_sampling_drops_uniform_groups_and_counts_them(tmp_path):
    constant = tmp_path / "constant.py"
    constant.write_text("def one(response, ground_truth, **context):\n    return 1.0\n")
    cfg = config(
        f"{constant}:one",
        **{"algorithm.dynamic_sampling": True, "algorithm.max_gen_rounds": 2},
    )
    run(cfg, tmp_path / "run")
    for m in steps(tmp_path / "run"):
        assert m["samples/trained"] == 0 and m["samples/gen_rounds"] == 2
        assert m["samples/generated"] == 12 == m["samples/filtered_uniform_group"]
    assert len(events(tmp_path / "run", "skipped_step")) == 6


def test_schedules_that_generate_ahead_refuse_dynamic_sampling():
    with pytest.raises(ConfigError, match="not supported with schedule.mode=async"):
        config("numeric", **{"schedule.mode": "async", "algorithm.dynamic_sampling": True})


FLAKY_REWARD = """
def flaky(response, ground_truth, **context):
    if len(response) % 2 == 0:
        raise ValueError("even-length answer")
    return 1.0 if len(response) == 1 else 0.0
"""


@pytest.mark.parametrize("policy", ["drop", "zero"])
def test_failed_scores_are_counted_as_failed_or_trained(tmp_path, policy):
    reward = tmp_path / "flaky.py"
    reward.write_text(FLAKY_REWARD)
    overrides = {"reward.on_error": policy, "trainer.val_at_start": False, "trainer.val_every": 0}
    run(config(f"{reward}:flaky", **overrides), tmp_path / "run")
    trained = steps(tmp_path / "run")
    for m in trained:
        assert m["samples/generated"] == 6 == m["samples/trained"] + m["samples/failed"]
    errors = sum(m["samples/score_errors"] for m in trained)
    assert errors > 0  # the flaky function did fail, so the counts above are not trivial
    failed = sum(m["samples/failed"] for m in trained)
    assert failed == (errors if policy == "drop" else 0)
