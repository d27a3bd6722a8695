"""Tests for the console summary line: ETA and progress-bar formatting, TTY handling."""

import io
import math

import pytest

from honing.monitor import ConsoleSink, format_eta, progress_bar


@pytest.mark.parametrize(
    ("seconds", "expected"),
    [
        (0, "0s"),
        (0.4, "0s"),
        (42, "42s"),
        (59.4, "59s"),
        (59.6, "1m00s"),
        (78, "1m18s"),
        (605, "10m05s"),
        (3599, "59m59s"),
        (3600, "1h00m"),
        (7620, "2h07m"),
        (86399, "23h59m"),
        (86400, "1d00h"),
        (3 * 86400 + 4 * 3600 + 59, "3d04h"),
        (-5, "0s"),
        (math.nan, "?"),
        (math.inf, "?"),
    ],
)
def test_format_eta(seconds, expected):
    assert format_eta(seconds) == expected


@pytest.mark.parametrize(
    ("done", "total", "width", "expected"),
    [
        (0, 200, 20, "[....................] 0%"),
        (12, 200, 20, "[#...................] 6%"),
        (50, 200, 20, "[#####...............] 25%"),
        (199, 200, 20, "[###################.] 99%"),
        (200, 200, 20, "[####################] 100%"),
        (1, 3, 10, "[###.......] 33%"),
        (250, 200, 10, "[##########] 100%"),
        (-1, 200, 10, "[..........] 0%"),
    ],
)
def test_progress_bar(done, total, width, expected):
    assert progress_bar(done, total, width) == expected


def test_progress_bar_rejects_empty_total():
    with pytest.raises(ValueError):
        progress_bar(0, 0)


def test_console_sink_rejects_non_positive_total():
    with pytest.raises(ValueError, match="total_steps"):
        ConsoleSink(0, stream=io.StringIO())


def test_console_line_on_a_non_tty_stream():
    stream = io.StringIO()
    sink = ConsoleSink(200, stream=stream)
    metrics = {
        "critic/score/mean": 0.41,
        "val/accuracy": 0.35,
        "actor/pg_loss": -0.012,
        "actor/kl_loss": 0.0031,
        "actor/entropy": 1.234,
        "response_length/mean": 187.4,
        "perf/throughput": 1523.6,
        "timing_s/step": 0.42,
        "actor/grad_norm": 3.0,
    }
    sink.write(12, metrics)
    sink.close()

    assert stream.getvalue() == (
        "step 12/200 [#...................] 6% | score 0.41 | val/acc 0.35 | pg_loss -0.012"
        " | kl_loss 0.0031 | entropy 1.23 | len 187 | tok/s 1524 | 0.42 s/step | ETA 1m19s\n"
    )


def test_console_leaves_out_missing_metrics():
    stream = io.StringIO()
    sink = ConsoleSink(10, stream=stream)
    sink.write(5, {"actor/pg_loss": 0.5, "timing_s/step": 2.0})
    assert (
        stream.getvalue()
        == "step 5/10 [##########..........] 50% | pg_loss 0.5 | 2 s/step | ETA 10s\n"
    )


def test_console_eta_uses_the_median_step_time():
    stream = io.StringIO()
    sink = ConsoleSink(100, stream=stream)
    for step, seconds in enumerate([1.0, 1.0, 60.0, 1.0, 1.0], start=1):
        sink.write(step, {"timing_s/step": seconds})
    assert sink.format_line(5, {}).endswith("| 1 s/step | ETA 1m35s")


def test_log_file_gets_about_fifty_lines_plus_validation_and_the_last_step():
    stream = io.StringIO()
    sink = ConsoleSink(500, stream=stream)
    for step in range(1, 501):
        sink.write(step, {"timing_s/step": 0.1} | ({"val/accuracy": 0.5} if step == 25 else {}))
    steps = [int(line.split()[1].split("/")[0]) for line in stream.getvalue().splitlines()]
    assert steps == sorted(set(range(10, 501, 10)) | {25})


def test_console_measures_step_time_without_the_metric():
    stream = io.StringIO()
    sink = ConsoleSink(10, stream=stream)
    sink.write(1, {})
    assert " s/step | ETA " in stream.getvalue()


def test_console_custom_keys_keep_their_order_and_names():
    stream = io.StringIO()
    sink = ConsoleSink(4, stream=stream, keys=["actor/grad_norm", "critic/score/mean"])
    sink.write(1, {"critic/score/mean": 0.5, "actor/grad_norm": 2.5, "actor/pg_loss": 1.0})
    assert stream.getvalue().startswith(
        "step 1/4 [#####...............] 25% | actor/grad_norm 2.5 | score 0.5 |"
    )


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def test_console_redraws_in_place_on_a_tty():
    stream = FakeTerminal()
    sink = ConsoleSink(2, stream=stream)
    sink.write(1, {"timing_s/step": 1.0})
    sink.write(2, {"timing_s/step": 1.0})
    sink.close()

    output = stream.getvalue()
    assert output.count("\r\x1b[K") == 2
    assert output.count("\n") == 1 and output.endswith("ETA 0s\n")


def test_console_note_keeps_the_progress_line_below_it():
    stream = FakeTerminal()
    sink = ConsoleSink(2, stream=stream)
    sink.write(1, {"timing_s/step": 1.0})
    sink.note("[alert] loss spike")

    line = "step 1/2 [##########..........] 50% | 1 s/step | ETA 1s"
    assert stream.getvalue() == f"\r\x1b[K{line}\r\x1b[K[alert] loss spike\n{line}"


def test_console_note_on_a_plain_stream_is_a_line():
    stream = io.StringIO()
    ConsoleSink(2, stream=stream).note("[restart] from_step=1")
    assert stream.getvalue() == "[restart] from_step=1\n"


def test_console_cuts_the_in_place_line_to_the_terminal_width():
    stream = FakeTerminal()
    sink = ConsoleSink(4, stream=stream, width=21)
    sink.write(1, {"timing_s/step": 1.0})
    assert stream.getvalue() == "\r\x1b[Kstep 1/4 [#####....."  # 20 = width - 1
    sink.write(4, {"timing_s/step": 1.0})  # the last line stays on screen whole
    assert stream.getvalue().endswith("| 1 s/step | ETA 0s\n")
