"""The rollout workers' autoscaling rule (``honing/backends/autoscale.py``) step by step, and a
Ray run under ``schedule.mode=sync`` that adds a worker on its own."""

import json
import signal
from dataclasses import replace

import pytest

from honing.backends.autoscale import Autoscaler, autoscaler_for, rollout_tasks
from honing.pipeline.run import train_here

from ._configs import small_run_config
from .fakes import BigramEngine, fake_components


def _scaler(workers=1, minimum=1, maximum=4, patience=2, tasks=8, asynchronous=True):
    return Autoscaler(workers, minimum, maximum, patience, tasks, asynchronous)


def _waited(trainer=0.0, engine=0.0, step=1.0):
    """An async step's metrics: the trainer's and generation's waits in a step of ``step`` s."""
    return {"timing_s/trainer_idle": trainer, "timing_s/engine_idle": engine, "timing_s/step": step}


def _sync(gen, update, prepare=0.0):
    return {"timing_s/gen": gen, "timing_s/update": update, "timing_s/prepare": prepare}


STARVED = _waited(trainer=0.5)  # the trainer waited half the step for its batch
AHEAD = _waited(engine=0.6)  # generation waited 60% of the step for admission
BALANCED = _waited(trainer=0.05, engine=0.05)  # both under WAIT_FRACTION: noise


def test_grows_after_patience_steps_of_a_waiting_trainer():
    scaler = _scaler(patience=2)
    assert scaler.observe(STARVED) is None
    change = scaler.observe(STARVED)
    assert (change.before, change.after) == (1, 2)
    assert "the trainer waited 0.5 s of a 1 s step" in change.reason
    assert scaler.workers == 2


def test_a_step_that_does_not_wait_breaks_the_run_of_steps():
    scaler = _scaler(patience=2)
    for metrics in (STARVED, BALANCED, STARVED):
        assert scaler.observe(metrics) is None
    assert scaler.observe(STARVED).after == 2


def test_after_a_change_the_next_needs_patience_fresh_steps():
    scaler = _scaler(patience=3)
    changes = [scaler.observe(STARVED) for _ in range(9)]
    assert [c.after if c else None for c in changes] == [None, None, 2, None, None, 3] + [
        None,
        None,
        4,
    ]


def test_never_grows_past_autoscale_max():
    scaler = _scaler(workers=2, maximum=3, patience=1)
    assert scaler.observe(STARVED).after == 3
    assert [scaler.observe(STARVED) for _ in range(3)] == [None] * 3
    assert scaler.workers == 3


def test_never_grows_past_the_tasks_of_a_batch():
    scaler = _scaler(maximum=8, patience=1, tasks=2)  # 2 tasks: a third worker would idle
    assert scaler.observe(STARVED).after == 2
    assert scaler.observe(STARVED) is None
    overrides = {
        "pipeline.backend": "ray",
        "pipeline.autoscale_max": 8,
        "rollout.batch_size": 5,
        "pipeline.rollout_chunk": 2,
    }
    config = small_run_config("model", "reward.py:score", **overrides)  # read, never loaded
    assert rollout_tasks(config) == 3  # ceil(5 / 2)
    assert autoscaler_for(config).maximum == 3
    off = small_run_config("model", "reward.py:score", **{"pipeline.backend": "ray"})
    assert autoscaler_for(off) is None  # autoscale_max=0


def test_shrinks_when_one_worker_fewer_would_keep_up():
    scaler = _scaler(workers=3, minimum=2, patience=2)
    # 3 workers: generation idle 30% of the step is under 1/3, two would not keep up
    assert [scaler.observe(_waited(engine=0.3)) for _ in range(3)] == [None] * 3
    assert scaler.observe(AHEAD) is None  # 60% > 1/3: the first of two
    change = scaler.observe(AHEAD)
    assert (change.before, change.after) == (3, 2)
    assert "2 worker(s) would keep up" in change.reason
    assert [scaler.observe(AHEAD) for _ in range(4)] == [None] * 4  # autoscale_min=2


def test_an_alternating_wait_changes_nothing():
    scaler = _scaler(workers=2, patience=2)
    assert [scaler.observe(m) for m in (STARVED, AHEAD) * 3] == [None] * 6


def test_sync_grows_while_generation_outlasts_the_trainers_work():
    scaler = _scaler(patience=1, asynchronous=False)
    assert scaler.observe(_sync(gen=1.0, update=0.7, prepare=0.4)) is None  # 1.0 < 1.1
    assert scaler.observe(_sync(gen=1.0, update=0.1)).after == 2
    assert scaler.observe({"timing_s/gen": 5.0}) is None  # a skipped step: no update
    # async metrics mean nothing to a sync run, and the reverse
    assert scaler.observe(STARVED) is None
    assert _scaler(patience=1).observe(_sync(gen=5.0, update=0.1)) is None


def test_sync_shrinks_when_fewer_workers_would_still_be_faster_than_the_trainer():
    scaler = _scaler(workers=3, patience=1, asynchronous=False)
    assert scaler.observe(_sync(gen=0.7, update=1.0)) is None  # 2 workers: 1.05 s > 1 s
    assert scaler.observe(_sync(gen=0.6, update=1.0)).after == 2  # 2 workers: 0.9 s
    assert scaler.observe(_sync(gen=0.9, update=1.0)) is None  # 1 worker: 1.8 s
    assert scaler.observe(_sync(gen=0.4, update=1.0)).after == 1


class Recording(BigramEngine):
    """A ``BigramEngine`` that keeps the metrics of each step handed to it."""

    def __init__(self, model, tokenizer):
        super().__init__(model, tokenizer)
        self.steps: list[dict] = []

    def step_done(self, metrics: dict[str, float]) -> None:
        self.steps.append(metrics)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_loop_hands_each_steps_metrics_to_the_training_engine(tmp_path, digit_reward, mode):
    engines = []

    def build(config, log=print):
        parts = fake_components(config, log)
        engines.append(Recording(parts.engine.model, parts.engine.tokenizer))
        return replace(parts, engine=engines[-1], val_engine=engines[-1])

    overrides = {"trainer.total_steps": 3, "schedule.mode": mode, "monitor.system_metrics": False}
    config = small_run_config("unused", digit_reward, **overrides)
    train_here(config, tmp_path / "run", "never", log=lambda message: None, build=build)
    logged = [m for m in _records(tmp_path / "run" / "metrics") if m["step"] >= 1]
    seen = engines[0].steps
    assert [m["timing_s/step"] for m in seen] == [m["timing_s/step"] for m in logged]
    assert len(seen) == 3 and all(m.items() <= logged[i].items() for i, m in enumerate(seen))
    waits = ("timing_s/gen", "timing_s/update") if mode == "sync" else ("timing_s/trainer_idle",)
    assert all(key in m for m in engines[0].steps for key in waits)


@pytest.mark.slow
def test_a_sync_run_adds_a_worker_when_generation_outlasts_the_update(
    tmp_path, micro_model_dir, digit_reward
):
    """One rollout worker, up to two: generation (in another process, the worker's start
    included at the first step) takes longer than the micro model's update, so after the
    first step the run asks for a second worker and the pool starts it; two is the top."""
    ray = pytest.importorskip("ray")
    from honing.backends import ray_run
    from honing.backends.launch import train

    config = small_run_config(
        micro_model_dir,
        digit_reward,
        **{
            "pipeline.backend": "ray",
            "pipeline.rollout_workers": 1,
            "pipeline.reward_workers": 0,
            "pipeline.rollout_chunk": 1,
            "pipeline.autoscale_max": 2,
            "pipeline.autoscale_patience": 1,
            "rollout.max_new_tokens": 24,
            "trainer.total_steps": 3,
            "trainer.val_at_start": False,
            "checkpoint.every": 0,
        },
    )
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    ray_run.start_local(num_cpus=4, log_to_driver=False)
    try:
        train(config, tmp_path / "run")
    finally:
        ray.shutdown()
        for sig, handler in handlers.items():  # ray.init installs its own
            signal.signal(sig, handler)
    metrics, events = (_records(tmp_path / "run" / name) for name in ("metrics", "events"))
    autoscaled = [e for e in events if e["kind"] == "rollout_workers_autoscaled"]
    assert [(e["before"], e["after"]) for e in autoscaled] == [(1, 2)], metrics
    assert "generation took" in autoscaled[0]["reason"]
    workers = [m["ray/rollout_workers"] for m in metrics]
    assert workers[0] == 1 and max(workers) == 2 and workers[-1] == 2
    assert metrics[-1]["ray/rollout_workers_target"] == 2
    assert not any(e["kind"] == "autoscale_overridden" for e in events)


def _records(path) -> list[dict]:
    """The records of a run's ``.jsonl`` file ``path`` (its name without the suffix)."""
    lines = path.with_suffix(".jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]
