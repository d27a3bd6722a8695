"""Tests for the metric sinks and the RunLogger that owns a run directory's log files."""

import io
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from honing.monitor import JsonlSink, RunLogger, TensorBoardSink, aggregate, truncate_jsonl


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def tensorboard_scalars(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir))
    accumulator.Reload()
    return {
        tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
        for tag in accumulator.Tags()["scalars"]
    }


def test_jsonl_sink_is_readable_before_close(tmp_path):
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    sink.write(1, {"actor/pg_loss": -0.5, "critic/score/mean": 0.25})

    (record,) = read_jsonl(tmp_path / "metrics.jsonl")
    assert record["step"] == 1
    assert record["actor/pg_loss"] == -0.5
    assert record["critic/score/mean"] == 0.25
    assert isinstance(record["time"], float)
    assert list(record) == ["step", "actor/pg_loss", "critic/score/mean", "time"]
    sink.close()


def test_jsonl_sink_writes_non_finite_as_null(tmp_path):
    with_nan = {"a": math.nan, "b": math.inf, "c": -math.inf, "d": 1.5}
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    sink.write(3, with_nan)
    sink.append([{"nested": [math.nan, {"x": math.inf}], "t": (1, 2)}])
    sink.close()

    text = (tmp_path / "metrics.jsonl").read_text(encoding="utf-8")
    assert "NaN" not in text and "Infinity" not in text
    first, second = read_jsonl(tmp_path / "metrics.jsonl")
    assert (first["a"], first["b"], first["c"], first["d"]) == (None, None, None, 1.5)
    assert second == {"nested": [None, {"x": None}], "t": [1, 2]}


def test_jsonl_sink_appends_to_an_existing_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    first = JsonlSink(path)
    first.write(1, {"loss": 1.0})
    first.close()
    second = JsonlSink(path)
    second.write(2, {"loss": 2.0})
    second.close()

    assert [record["step"] for record in read_jsonl(path)] == [1, 2]


def test_jsonl_sink_starts_a_new_line_after_a_torn_one(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "lo', encoding="utf-8")
    sink = JsonlSink(path)
    sink.write(2, {"loss": 2.0})
    sink.close()

    lines = path.read_text(encoding="utf-8").splitlines()
    assert lines[1] == '{"step": 2, "lo'
    assert json.loads(lines[2])["loss"] == 2.0


def test_jsonl_sink_refuses_writes_after_close(tmp_path):
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    sink.close()
    with pytest.raises(ValueError, match="closed"):
        sink.write(1, {"loss": 1.0})


def test_truncate_jsonl_drops_later_steps_and_torn_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [
        {"step": 1, "loss": 1.0},
        {"note": "no step"},
        {"step": 2, "loss": 2.0},
        {"step": 3, "loss": 3.0},
        {"step": 2, "sample": "late write of step 2"},
    ]
    text = "".join(json.dumps(line) + "\n" for line in lines) + '{"step": 4, "lo'
    path.write_text(text, encoding="utf-8")

    assert truncate_jsonl(path, 2) == 2
    assert read_jsonl(path) == [lines[0], lines[1], lines[2], lines[4]]
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]


def test_truncate_jsonl_of_missing_file_is_a_no_op(tmp_path):
    assert truncate_jsonl(tmp_path / "absent.jsonl", 5) == 0
    assert not (tmp_path / "absent.jsonl").exists()


def test_tensorboard_sink_round_trip(tmp_path):
    sink = TensorBoardSink(tmp_path / "tb")
    sink.write(1, {"critic/score/mean": 0.25, "actor/pg_loss": -0.5})
    sink.write(2, {"critic/score/mean": 0.75, "actor/pg_loss": -0.125})

    scalars = tensorboard_scalars(tmp_path / "tb")
    assert scalars["critic/score/mean"] == [(1, 0.25), (2, 0.75)]
    assert scalars["actor/pg_loss"] == [(1, -0.5), (2, -0.125)]
    sink.close()


def test_tensorboard_restart_marker_hides_steps_after_it(tmp_path):
    sink = TensorBoardSink(tmp_path / "tb")
    for step in (1, 2, 3):
        sink.write(step, {"loss": float(step)})
    sink.mark_restart(1)
    sink.write(2, {"loss": 20.0})
    sink.close()

    assert tensorboard_scalars(tmp_path / "tb")["loss"] == [(1, 1.0), (2, 20.0)]


def test_aggregate_means_and_skips_empty_lists():
    result = aggregate({"loss": [1.0, 2.0, 6.0], "empty": [], "one": [0.5]})
    assert result == {"loss": 3.0, "one": 0.5}


def test_aggregate_keeps_nan_visible():
    assert math.isnan(aggregate({"loss": [1.0, math.nan]})["loss"])


def test_run_logger_writes_every_file(tmp_path):
    stream = io.StringIO()
    with RunLogger(tmp_path / "run", total_steps=10, stream=stream) as logger:
        logger.log_metrics(1, {"critic/score/mean": 0.5})
        logger.log_samples(1, [{"prompt": "1+1", "reward": 1.0}, {"prompt": "2+2", "reward": 0}])
        logger.log_event("skipped_step", step=1, reason="all rewards equal")

    run = tmp_path / "run"
    assert read_jsonl(run / "metrics.jsonl")[0]["critic/score/mean"] == 0.5
    assert read_jsonl(run / "samples.jsonl") == [
        {"step": 1, "prompt": "1+1", "reward": 1.0},
        {"step": 1, "prompt": "2+2", "reward": 0},
    ]
    (event,) = read_jsonl(run / "events.jsonl")
    assert event["kind"] == "skipped_step" and event["reason"] == "all rewards equal"
    assert list(event)[:2] == ["time", "kind"]
    assert tensorboard_scalars(run / "tensorboard")["critic/score/mean"] == [(1, 0.5)]
    output = stream.getvalue()
    assert "step 1/10" in output and "score 0.5" in output
    assert "[skipped_step] step=1 reason=all rewards equal" in output


def test_run_logger_without_tensorboard_or_console(tmp_path):
    stream = io.StringIO()
    with RunLogger(tmp_path, total_steps=3, tensorboard=False, console=False, stream=stream) as log:
        log.log_metrics(1, {"loss": 1.0})
    assert not (tmp_path / "tensorboard").exists()
    assert stream.getvalue() == ""


def test_run_logger_resume_appends_and_truncates(tmp_path):
    with RunLogger(tmp_path, total_steps=5, console=False) as logger:
        for step in (1, 2, 3):
            logger.log_metrics(step, {"loss": float(step)})
            logger.log_samples(step, [{"text": f"s{step}"}])
        logger.log_event("alert", rule="loss_spike")

    with RunLogger(tmp_path, total_steps=5, console=False) as logger:
        dropped = logger.truncate_after(1)
        logger.log_event("restart", from_step=1)
        logger.log_metrics(2, {"loss": 20.0})
        logger.log_samples(2, [{"text": "again"}])

    assert dropped == {"metrics.jsonl": 2, "samples.jsonl": 2}
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    assert [(m["step"], m["loss"]) for m in metrics] == [(1, 1.0), (2, 20.0)]
    samples = read_jsonl(tmp_path / "samples.jsonl")
    assert [(s["step"], s["text"]) for s in samples] == [(1, "s1"), (2, "again")]
    assert [e["kind"] for e in read_jsonl(tmp_path / "events.jsonl")] == ["alert", "restart"]
    assert tensorboard_scalars(tmp_path / "tensorboard")["loss"] == [(1, 1.0), (2, 20.0)]


def test_run_logger_fans_out_to_extra_sinks(tmp_path):
    class Recorder:
        def __init__(self):
            self.writes, self.closed = [], False

        def write(self, step, metrics):
            self.writes.append((step, metrics))

        def close(self):
            self.closed = True

    recorder = Recorder()
    with RunLogger(
        tmp_path, total_steps=2, tensorboard=False, console=False, sinks=[recorder]
    ) as log:
        log.log_metrics(1, {"loss": 1.0})
    assert recorder.writes == [(1, {"loss": 1.0})]
    assert recorder.closed


def test_importing_monitor_does_not_import_tensorboard_or_torch():
    code = (
        "import sys, honing.monitor, honing.checkpoint\n"
        "heavy = [m for m in ('tensorboard', 'torch') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    repo_root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=repo_root)
