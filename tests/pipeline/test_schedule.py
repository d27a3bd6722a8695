"""The one_step and async schedules: staleness within bounds, every sample accounted for,
checkpoints that record the data cursor of the next step to train, errors that surface."""

import json

import pytest

from honing.backends.launch import train
from honing.errors import ConfigError

from ._configs import small_run_config

NO_LOG = lambda message: None  # noqa: E731


def run(tmp_path, model_dir, reward, name="run", **overrides):
    values = {"trainer.total_steps": 5, "trainer.val_at_start": False, "trainer.lr": 1e-3}
    cfg = small_run_config(model_dir, reward, **values | overrides)
    train(cfg, tmp_path / name, log=NO_LOG)
    lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
    return [m for m in map(json.loads, lines) if m["step"] >= 1]


def accounted(m) -> bool:
    parts = ("samples/trained", "samples/filtered", "samples/failed", "samples/stale")
    return m["samples/generated"] == sum(m[k] for k in parts)


def test_one_step_samples_one_version_behind_and_is_deterministic(
    tmp_path, micro_model_dir, digit_reward
):
    first = run(tmp_path, micro_model_dir, digit_reward, "a", **{"schedule.mode": "one_step"})
    assert [m["async/staleness"] for m in first] == [0, 1, 1, 1, 1]
    assert [m["async/weight_version"] for m in first] == [0, 0, 1, 2, 3]
    assert all(accounted(m) and m["samples/stale"] == 0 for m in first)
    assert all(m["timing_s/trainer_idle"] >= 0 for m in first)
    again = run(tmp_path, micro_model_dir, digit_reward, "b", **{"schedule.mode": "one_step"})
    for key in ("critic/score/mean", "actor/pg_loss", "response_length/mean"):
        assert [m[key] for m in first] == [m[key] for m in again], key


def test_one_step_first_step_equals_sync(tmp_path, micro_model_dir, digit_reward):
    """Step 1 samples with the starting weights in both schedules: the same batch (the loss
    differs only by the importance weights of ``tis_level=auto``, ~1 on-policy)."""
    sync = run(tmp_path, micro_model_dir, digit_reward, "sync", **{"trainer.total_steps": 1})
    one = run(
        tmp_path,
        micro_model_dir,
        digit_reward,
        "one",
        **{"trainer.total_steps": 1, "schedule.mode": "one_step"},
    )
    for key in ("critic/score/mean", "response_length/mean"):
        assert sync[0][key] == one[0][key], key
    assert one[0]["actor/pg_loss"] == pytest.approx(sync[0]["actor/pg_loss"], rel=1e-4)


@pytest.mark.parametrize("staleness", [0, 2])
def test_async_keeps_staleness_within_the_bound(tmp_path, micro_model_dir, digit_reward, staleness):
    metrics = run(
        tmp_path,
        micro_model_dir,
        digit_reward,
        **{"schedule.mode": "async", "schedule.max_staleness": staleness},
    )
    assert len(metrics) == 5
    assert all(0 <= m["async/staleness"] <= staleness for m in metrics)
    assert all(accounted(m) for m in metrics)
    assert sum(m["samples/trained"] for m in metrics) > 0


def test_checkpoint_records_the_cursor_of_the_next_step_to_train(
    tmp_path, micro_model_dir, digit_reward
):
    """Prompts drawn ahead are not lost: the checkpoint's data cursor is the one before the
    next step's prompts, as a sync run's is; a resumed run regenerates them."""
    common = {"trainer.total_steps": 4, "checkpoint.every": 2, "data.train_size": 40}
    run(tmp_path, micro_model_dir, digit_reward, "sync", **common)
    run(tmp_path, micro_model_dir, digit_reward, "one", **common | {"schedule.mode": "one_step"})

    def cursor(name, step):
        path = tmp_path / name / "checkpoints" / f"step_{step}" / "state.json"
        return json.loads(path.read_text())["data"]

    assert cursor("one", 2) == cursor("sync", 2)
    assert cursor("one", 4) == cursor("sync", 4)


def test_resume_under_one_step_continues_the_run(tmp_path, micro_model_dir, digit_reward):
    common = {"schedule.mode": "one_step", "checkpoint.every": 2}
    run(tmp_path, micro_model_dir, digit_reward, "r", **common | {"trainer.total_steps": 2})
    cfg = small_run_config(
        micro_model_dir,
        digit_reward,
        **common | {"trainer.total_steps": 4, "trainer.val_at_start": False},
    )
    train(cfg, tmp_path / "r", resume="auto", log=NO_LOG)
    lines = (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line)["step"] for line in lines]
    assert steps == [1, 2, 3, 4]


def test_a_scoring_failure_reaches_the_trainer(tmp_path, micro_model_dir):
    reward = tmp_path / "boom.py"
    reward.write_text(
        "def boom(response, ground_truth, **context):\n    raise ValueError('verifier down')\n"
    )
    cfg = small_run_config(
        micro_model_dir,
        f"{reward}:boom",
        **{"schedule.mode": "async", "reward.on_error": "fail", "trainer.total_steps": 3},
    )
    with pytest.raises(Exception, match="verifier down"):
        train(cfg, tmp_path / "run", log=NO_LOG)


@pytest.mark.parametrize(
    "override", [{"algorithm.dynamic_sampling": True}, {"algorithm.advantage": "remax"}]
)
def test_unsupported_combinations_say_so(tmp_path, micro_model_dir, digit_reward, override):
    cfg = small_run_config(micro_model_dir, digit_reward, **{"schedule.mode": "async", **override})
    with pytest.raises(ConfigError, match="not supported with schedule.mode=async"):
        train(cfg, tmp_path / "run", log=NO_LOG)


def test_a_batch_staler_than_allowed_is_dropped_and_counted(micro_model_dir, digit_reward):
    """Admission keeps this from happening in a run; should versions move backwards (a
    remote engine behind), the whole batch is dropped and counted as stale, its timings and
    latencies kept for the metrics."""
    from honing.pipeline.collect import Collected
    from honing.pipeline.components import build_components
    from honing.pipeline.producer import Produced, RolloutProducer
    from honing.types import Rollout, Score

    cfg = small_run_config(
        micro_model_dir, digit_reward, **{"schedule.mode": "async", "trainer.total_steps": 3}
    )
    parts = build_components(cfg, log=NO_LOG)
    producer = RolloutProducer(cfg, parts, start=3, seed_of=lambda step: step)  # nothing to do
    rollouts = [Rollout("p", 0, [5, 6], [7], [-0.5], "stop", 2, "7") for _ in range(3)]
    scores = [Score(1.0) for _ in rollouts]
    kept = list(zip(rollouts, scores, strict=True))
    got = Collected(rollouts, scores, kept=kept, latencies_ms=[4.0])
    producer._ready[6] = Produced(step=6, version=2, source_state={}, collected=got)
    taken, metrics = producer.take(6)  # staleness (6 - 1) - 2 = 3 > max_staleness 1
    assert producer.close() == 0
    assert metrics["samples/stale"] == 3 and metrics["async/staleness"] == 3
    assert taken.kept == [] and taken.rollouts == rollouts and taken.latencies_ms == [4.0]
