"""Tests for the metric sinks and the RunLogger that owns a run directory's log files."""

import io
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from honing.monitor import JsonlSink, RunLogger, TensorBoardSink, aggregate, truncate_jsonl
from honing.monitor.logger import distribution_metrics
from honing.monitor.tensorboard_sink import histogram_proto


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


def test_jsonl_sink_drops_a_torn_last_line(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "lo', encoding="utf-8")
    sink = JsonlSink(path)
    sink.write(2, {"loss": 2.0})
    sink.close()

    lines = path.read_text(encoding="utf-8").splitlines()
    assert [json.loads(line)["loss"] for line in lines] == [1.0, 2.0]


def test_jsonl_sink_keeps_a_whole_last_record_without_its_newline(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text('{"step": 1, "loss": 1.0}', encoding="utf-8")
    sink = JsonlSink(path)
    sink.write(2, {"loss": 2.0})
    sink.close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]


def test_jsonl_sink_drops_a_torn_line_longer_than_a_block(tmp_path):
    path = tmp_path / "samples.jsonl"
    path.write_text('{"step": 1}\n{"response": "' + "x" * 200_000, encoding="utf-8")
    JsonlSink(path).close()
    assert path.read_text(encoding="utf-8") == '{"step": 1}\n'


def test_jsonl_sink_drops_a_file_of_one_torn_line(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_bytes(b'{"kind": "resu')
    JsonlSink(path).close()
    assert path.read_bytes() == b""


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


def tensorboard_histograms(log_dir):
    """Tag -> [(step, [(left, right, count), ...])], as TensorBoard's loader reads them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir), size_guidance={"histograms": 0})  # keep all
    accumulator.Reload()
    result = {}
    for tag in accumulator.Tags()["histograms"]:
        for event in accumulator.Histograms(tag):
            value = event.histogram_value
            lefts = [value.min, *value.bucket_limit[:-1]]
            buckets = list(zip(lefts, value.bucket_limit, value.bucket, strict=True))
            result.setdefault(tag, []).append((event.step, value.num, buckets))
    return result


def test_histogram_proto_one_bucket_per_integer():
    proto = histogram_proto([1, 2, 2, 4, math.nan])
    assert (proto.min, proto.max, proto.num, proto.sum, proto.sum_squares) == (1, 4, 4, 9, 25)
    assert list(proto.bucket_limit) == [1.5, 2.5, 3.5, 4.5]
    assert list(proto.bucket) == [1, 2, 0, 1]


def test_histogram_proto_of_real_values_and_of_nothing():
    proto = histogram_proto([0.0, 0.25, 1.0], max_buckets=4)
    assert list(proto.bucket_limit) == [0.25, 0.5, 0.75, 1.0]
    assert list(proto.bucket) == [1, 1, 0, 1]  # numpy's last bucket includes its right edge
    same = histogram_proto([0.5, 0.5])
    assert (list(same.bucket_limit), list(same.bucket)) == ([1.0], [2])
    assert histogram_proto([]) is None and histogram_proto([math.inf]) is None


def test_tensorboard_histograms_round_trip(tmp_path):
    sink = TensorBoardSink(tmp_path / "tb")
    sink.write_histograms(1, {"response_length": [1, 2, 2, 4], "critic/score": [math.nan]})
    sink.write_histograms(2, {"response_length": [3, 3]})
    sink.close()

    histograms = tensorboard_histograms(tmp_path / "tb")
    assert list(histograms) == ["response_length"]  # all-NaN values write no histogram
    (step1, num1, buckets1), (step2, num2, buckets2) = histograms["response_length"]
    assert (step1, num1, buckets1[1]) == (1, 4, (1.5, 2.5, 2))
    assert (step2, num2, buckets2) == (2, 2, [(3, 3.5, 2)])


def test_distribution_metrics_hand_checked():
    assert distribution_metrics("len", [5, 1, 4, 2, 3, math.nan]) == {
        "len/min": 1,
        "len/p10": 1.4,  # rank 0.4 between 1 and 2
        "len/p25": 2,
        "len/p50": 3,
        "len/p75": 4,
        "len/p90": 4.6,
        "len/max": 5,
    }
    assert distribution_metrics("x", [7])["x/p90"] == 7
    assert distribution_metrics("x", [math.nan]) == {}


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
        log.log_metrics(1, {"actor/pg_loss": 1.0})
    assert not (tmp_path / "tensorboard").exists()
    assert stream.getvalue() == ""


def test_run_logger_resume_appends_and_truncates(tmp_path):
    with RunLogger(tmp_path, total_steps=5, console=False) as logger:
        for step in (1, 2, 3):
            logger.log_metrics(step, {"actor/pg_loss": float(step)})
            logger.log_samples(step, [{"text": f"s{step}"}])
        logger.log_event("alert", rule="loss_spike")

    with RunLogger(tmp_path, total_steps=5, console=False) as logger:
        dropped = logger.truncate_after(1)
        logger.log_event("restart", from_step=1)
        logger.log_metrics(2, {"actor/pg_loss": 20.0})
        logger.log_samples(2, [{"text": "again"}])

    assert dropped == {"metrics.jsonl": 2, "samples.jsonl": 2}
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    assert [(m["step"], m["actor/pg_loss"]) for m in metrics] == [(1, 1.0), (2, 20.0)]
    samples = read_jsonl(tmp_path / "samples.jsonl")
    assert [(s["step"], s["text"]) for s in samples] == [(1, "s1"), (2, "again")]
    assert [e["kind"] for e in read_jsonl(tmp_path / "events.jsonl")] == ["alert", "restart"]
    assert tensorboard_scalars(tmp_path / "tensorboard")["actor/pg_loss"] == [(1, 1.0), (2, 20.0)]


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
        log.log_metrics(1, {"actor/pg_loss": 1.0})
    assert recorder.writes == [(1, {"actor/pg_loss": 1.0})]
    assert recorder.closed


def test_run_logger_sends_histograms_only_to_sinks_that_take_them(tmp_path):
    class Plain:
        def write(self, step, metrics):
            pass

        def close(self):
            pass

    class WithHistograms(Plain):
        def __init__(self):
            self.histograms = []

        def write_histograms(self, step, histograms):
            self.histograms.append((step, histograms))

    taking = WithHistograms()
    with RunLogger(tmp_path, total_steps=2, console=False, sinks=[Plain(), taking]) as log:
        log.log_histograms(2, {"critic/score": [0.0, 1.0]})
    assert taking.histograms == [(2, {"critic/score": [0.0, 1.0]})]
    assert tensorboard_histograms(tmp_path / "tensorboard")["critic/score"][0][:2] == (2, 2)


def test_run_logger_close_closes_every_sink_even_if_one_fails(tmp_path):
    closed = []

    class Failing:
        def write(self, step, metrics):
            pass

        def close(self):
            raise OSError("remote tracker unreachable")

    class Recording(Failing):
        def close(self):
            closed.append(True)

    logger = RunLogger(
        tmp_path, total_steps=2, tensorboard=False, console=False, sinks=[Failing(), Recording()]
    )
    with pytest.raises(OSError, match="unreachable"):
        logger.close()
    assert closed == [True]
    with pytest.raises(ValueError, match="closed"):
        logger.log_samples(1, [{"x": 1}])


def test_importing_monitor_does_not_import_heavy_modules():
    code = (
        "import sys, honing.monitor, honing.checkpoint\n"
        "heavy = ('tensorboard', 'torch', 'numpy', 'http.server')\n"
        "heavy = [m for m in heavy if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    repo_root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=repo_root)
