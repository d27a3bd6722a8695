"""Every log a run writes, on a real full disk (a small tmpfs): TensorBoard's event files, the
JSONL logs when rewritten at a resume, events written by other threads, an MLflow store, the
HTML report. Each ends the run (or ``honing report``) with the one line a checkpoint that
finds no room gives, and no traceback, a thread's included."""

import errno
import json
import threading

import pytest

from honing.cli import main
from honing.errors import UserError
from honing.monitor import RunLogger, TensorBoardSink
from honing.monitor.sinks import cannot_write
from tests.pipeline._configs import cli_args

FULL = "the disk is full (0.0 MiB free there); free some space, then resume with --resume auto"


@pytest.fixture
def thread_errors(monkeypatch):
    """What reached ``threading.excepthook`` (a thread's traceback on stderr) in the test."""
    seen = []
    monkeypatch.setattr(threading, "excepthook", lambda args: seen.append(args.exc_value))
    return seen


def fill(disk):
    """Takes the room left on ``disk`` with one file, which it returns."""
    filler = disk / "filler"
    with filler.open("wb", buffering=0) as handle:
        try:
            while True:
                handle.write(bytes(4096))
        except OSError as err:
            assert err.errno == errno.ENOSPC
    return filler


def tensorboard_steps(log_dir):
    """Steps of ``critic/score/mean`` in the event files, read by TensorBoard's loader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir))
    accumulator.Reload()
    return [event.step for event in accumulator.Scalars("critic/score/mean")]


def test_a_full_disk_under_tensorboard_ends_the_run_with_one_line(
    micro_model_dir, digit_reward, tmpfs, tmp_path, capfd, thread_errors
):
    """TensorBoard's files on a disk of their own, 8 KiB: the run directory has room, the
    event file stops growing after a few steps. The step whose event finds no room ends the
    run as a checkpoint on a full disk does (exit 2, one line), and the event file keeps only
    whole records."""
    run_dir = tmp_path / "run"
    board = tmpfs("8k", run_dir / "tensorboard")
    steps = {"trainer.total_steps": 40, "checkpoint.every": 0, "monitor.tensorboard": True}

    status = main(["train", *cli_args(micro_model_dir, digit_reward, run_dir, **steps)])

    said = capfd.readouterr().err
    lines = [line for line in said.splitlines() if line.strip()]
    assert status == 2 and len(lines) == 1, said
    assert "Traceback" not in said and thread_errors == []
    [event_file] = board.iterdir()
    assert lines[0] == f"honing: error: cannot write {event_file}: {FULL}"
    logged = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").open()]
    assert 1 < len(logged) < 41
    # step 0 validates only; the last step's event found no room
    assert tensorboard_steps(board) == logged[1:-1]


def test_a_tensorboard_event_that_finds_no_room_is_cut_off_whole(tmpfs, tmp_path):
    """The event that does not fit leaves nothing of itself; once there is room again the
    event file goes on, readable to its end."""
    disk = tmpfs("16k", tmp_path / "disk")
    sink = TensorBoardSink(disk / "tb")
    sink.write(1, {"critic/score/mean": 0.5})
    filler = fill(disk)
    histograms = {"response_length": list(range(5000))}  # ~1 KiB: more than a block's end

    with pytest.raises(UserError) as raised:
        for _ in range(8):
            sink.write_histograms(2, histograms)
    assert str(raised.value) == f"cannot write {sink.path}: {FULL}"
    filler.unlink()
    sink.write(3, {"critic/score/mean": 0.75})
    sink.close()
    assert tensorboard_steps(disk / "tb") == [1, 3]


def test_a_full_disk_when_the_event_file_is_made_is_one_line(tmpfs, tmp_path):
    disk = tmpfs("8k", tmp_path / "disk")
    fill(disk)
    with pytest.raises(UserError) as raised:
        TensorBoardSink(disk / "tb")
    [made] = (disk / "tb").iterdir()
    assert made.name.startswith("events.out.tfevents.") and made.stat().st_size == 0
    assert str(raised.value) == f"cannot write {made}: {FULL}"


def test_an_event_another_thread_cannot_write_ends_the_run_on_its_own_thread(
    tmpfs, tmp_path, thread_errors
):
    """The alert watchdog and webhook failures log events from threads of their own: on a
    full disk nothing is raised there; the run's thread raises the one line at its next call
    to the logger."""
    disk = tmpfs("8k", tmp_path / "disk")
    logger = RunLogger(disk / "run", total_steps=3, tensorboard=False, console=False)
    fill(disk)

    watchdog = threading.Thread(target=lambda: logger.log_event("alert", note="x" * 6000))
    watchdog.start()
    watchdog.join()

    assert thread_errors == []
    with pytest.raises(UserError) as raised:
        logger.log_metrics(1, {"critic/score/mean": 0.5})
    assert str(raised.value) == f"cannot write {disk / 'run' / 'events.jsonl'}: {FULL}"
    logger.close()
    assert (disk / "run" / "metrics.jsonl").read_text() == ""  # the step was not logged


def test_a_resume_that_cannot_rewrite_the_metrics_is_one_line(tmpfs, tmp_path):
    """A resumed run rewrites ``metrics.jsonl`` without the steps it redoes: with no room for
    the new file, the old one stays as it was."""
    disk = tmpfs("16k", tmp_path / "disk")
    (disk / "run").mkdir()
    lines = [
        {"step": step, "critic/score/mean": step / 4, "note": "x" * 1000} for step in (1, 2, 3)
    ]
    (disk / "run" / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    logger = RunLogger(disk / "run", total_steps=3, tensorboard=False, console=False)
    before = (disk / "run" / "metrics.jsonl").read_text()
    fill(disk)

    with pytest.raises(UserError) as raised:
        logger.truncate_after(1)
    assert str(raised.value) == f"cannot write {disk / 'run' / 'metrics.jsonl'}: {FULL}"
    logger.close()
    assert (disk / "run" / "metrics.jsonl").read_text() == before
    assert sorted(p.name for p in (disk / "run").iterdir()) == [
        "events.jsonl",
        "metrics.jsonl",
        "samples.jsonl",
    ]  # no temporary file left


def test_a_sink_whose_own_error_says_enospc_is_the_one_line(tmp_path):
    """Any sink (a tracker writing its local store) whose error names ENOSPC: the file it
    names, else the sink's ``local_path``."""

    class Tracker:
        local_path = tmp_path / "store.db"

        def __init__(self, err):
            self.err = err

        def write(self, step, metrics):
            raise RuntimeError("the store refused the write") from self.err

        def close(self):
            pass

    named = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "runs" / "m"))
    for err, where in ((named, tmp_path / "runs" / "m"), (OSError(errno.EDQUOT, "q"), None)):
        logger = RunLogger(
            tmp_path / "run", total_steps=1, tensorboard=False, console=False, sinks=[Tracker(err)]
        )
        with pytest.raises(UserError) as raised:
            logger.log_metrics(1, {"critic/score/mean": 0.5})
        logger.close()
        message = str(raised.value)
        assert message.startswith(f"cannot write {where or Tracker.local_path}: the disk is full")
        assert message.endswith("free some space, then resume with --resume auto")


def test_a_sink_error_that_is_not_a_full_disk_is_left_as_it_is(tmp_path):
    class Tracker:
        def write(self, step, metrics):
            raise ConnectionError("tracking server went away")

        def close(self):
            pass

    logger = RunLogger(tmp_path, total_steps=1, tensorboard=False, console=False, sinks=[Tracker()])
    with pytest.raises(ConnectionError):
        logger.log_metrics(1, {"critic/score/mean": 0.5})
    logger.close()


@pytest.mark.slow
def test_a_full_mlflow_store_ends_the_run_with_one_line(tmpfs, tmp_path, capfd, thread_errors):
    """MLflow keeping its runs in SQLite on a disk that fills: SQLite says "database or disk
    is full" (``SQLITE_FULL``, no errno), which reads as a full disk too, naming the store."""
    pytest.importorskip("mlflow")
    disk = tmpfs("4m", tmp_path / "disk")
    store = disk / "mlflow.db"
    monitor = {"mlflow_tracking_uri": f"sqlite:///{store}", "console": False, "tensorboard": False}
    logger = RunLogger.from_config(
        tmp_path / "run", type("Monitor", (), monitor)(), total_steps=100
    )
    fill(disk)
    metrics = {f"tool/metric_{index}": 0.5 for index in range(100)}

    with pytest.raises(UserError) as raised:
        for step in range(100):
            logger.log_metrics(step, metrics)
    with pytest.raises(UserError):  # ending the MLflow run finds no room either
        logger.close()

    assert str(raised.value) == f"cannot write {store}: {FULL}"
    said = capfd.readouterr().err
    assert "Traceback" not in said and thread_errors == [], said


def test_a_report_that_finds_no_room_is_one_line(tmpfs, tmp_path, capsys):
    disk = tmpfs("8k", tmp_path / "disk")
    run_dir = disk / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "critic/score/mean": 0.5}\n')
    fill(disk)

    status = main(["report", str(run_dir)])

    said = capsys.readouterr().err.strip()
    assert status == 2 and "\n" not in said, said
    assert said == (
        f"honing: error: cannot write {run_dir / 'report.html'}: the disk is full (0.0 MiB "
        f"free there); free some space, then run honing report {run_dir} again"
    )
    assert sorted(p.name for p in run_dir.iterdir()) == ["metrics.jsonl"]


def test_cannot_write_reads_like_a_checkpoint_that_finds_no_room(tmp_path):
    """The line's end is the checkpoint's (``state.save_training_state``): what to do."""
    message = str(cannot_write(tmp_path / "x", OSError(errno.ENOSPC, "No space left on device")))
    assert message.startswith(f"cannot write {tmp_path / 'x'}: the disk is full (")
    assert message.endswith("MiB free there); free some space, then resume with --resume auto")
    other = str(cannot_write(tmp_path / "x", PermissionError(errno.EACCES, "Permission denied")))
    assert other == f"cannot write {tmp_path / 'x'} (Permission denied); fix that, then " + (
        "resume with --resume auto"
    )
