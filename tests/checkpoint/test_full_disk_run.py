"""A training run whose disk fills up, on a real tmpfs: failed saves are reported and retried,
the earlier checkpoint stays loadable, a failed final save stops the run with one line, and
so does a log file that cannot be written, which is left without a torn line."""

import json

import pytest
import torch

from honing.backends.launch import train
from honing.checkpoint import CheckpointManager, CheckpointSaveError, verify
from honing.cli import main
from honing.errors import UserError
from honing.pipeline.supervise import supervise
from tests.pipeline._configs import cli_args, small_run_config
from tests.pipeline._warm_python import warm_python


def events_of(run_dir):
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def test_a_full_disk_mid_run(micro_model_dir, digit_reward, tmpfs):
    """600 KiB: room for one micro-model checkpoint (~350 KiB) and the logs."""
    config = small_run_config(
        micro_model_dir,
        digit_reward,
        **{"trainer.total_steps": 3, "checkpoint.every": 1, "checkpoint.keep": 1},
    )
    run_dir = tmpfs("600k") / "run"

    with pytest.raises(UserError) as raised:
        train(config, run_dir, log=lambda message: None)

    message = str(raised.value)
    assert "\n" not in message
    assert f"could not save the checkpoint of step 3 under {run_dir / 'checkpoints'}" in message
    assert (
        "the disk is full (0." in message
        and "MiB free there, a checkpoint needs about 0.3" in message
    )
    assert message.endswith("free some space, then resume with --resume auto")
    failed = [e for e in events_of(run_dir) if e["kind"] == "checkpoint_failed"]
    assert [e["step"] for e in failed] == [2, 3]  # step 2 failed, the run went on to step 3
    assert all(e["disk_full"] and e["free_bytes"] < 1 << 20 for e in failed)
    newest = run_dir / "checkpoints" / "step_1"
    size = sum(p.stat().st_size for p in newest.rglob("*") if p.is_file())
    assert all(e["needed_bytes"] == size for e in failed)  # what the newest one took
    # The checkpoint of step 1 is whole and nothing partial is left beside it.
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_1"]
    assert verify(newest) is None
    steps = [
        json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps == [0, 1, 2, 3]


def test_no_room_for_the_model_file_stops_the_run_without_a_restart(
    micro_model_dir, digit_reward, tmpfs, tmp_path, capfd
):
    """64 KiB: the logs fit, the safetensors model (~95 KiB) of no checkpoint does. safetensors
    says so in its own error type (``SafetensorError: ... No space left on device (os error
    28)``), which must read as a full disk: each save a ``checkpoint_failed`` event, the final
    one a user error (exit 2), which ``--max-restarts`` does not restart."""
    run_dir = tmpfs("64k") / "run"
    steps = {"trainer.total_steps": 2, "checkpoint.every": 1}
    args = cli_args(micro_model_dir, digit_reward, run_dir, **steps)
    lines = []

    python = warm_python(tmp_path)
    status = supervise(args, 2, lines.append, restart_delay_s=0, python=python)

    said = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert status == 2 and lines == [], said
    assert len(said) == 1 and said[0].startswith("honing: error: could not save the checkpoint")
    assert "the disk is full" in said[0] and "a checkpoint needs about 0.3 MiB" in said[0]
    assert "SafetensorError" in said[0] and "No space left on device" in said[0]
    events = events_of(run_dir)
    assert "restart" not in [e["kind"] for e in events]
    failed = [e for e in events if e["kind"] == "checkpoint_failed"]
    assert [e["step"] for e in failed] == [1, 2] and all(e["disk_full"] for e in failed)
    assert list((run_dir / "checkpoints").iterdir()) == []  # no partial checkpoint


def test_a_full_disk_is_told_from_the_error_not_the_room_the_cleanup_freed(tmpfs):
    """torch's writer names no errno: "full" is read from the free space when the save
    failed, before its partial files (3 MiB here) were removed."""
    events = []
    manager = CheckpointManager(
        tmpfs("4m") / "checkpoints", keep=1, on_event=lambda kind, **f: events.append(f)
    )

    def write(directory):
        (directory / "model.safetensors").write_bytes(bytes(3 << 20))
        torch.save(torch.zeros(1 << 19), directory / "trainer_state.pt")  # 2 MiB more

    with pytest.raises(CheckpointSaveError, match="the disk is full"):
        manager.save(1, write, expected_bytes=lambda: 5 << 20)
    [failed] = events
    assert failed["disk_full"] and failed["free_bytes"] >= 3 << 20, failed  # the room came back
    assert failed["needed_bytes"] == 5 << 20 and "RuntimeError" in failed["reason"], failed
    assert "No space" not in failed["reason"]  # torch did not say why


def test_a_full_disk_while_logging_ends_the_run_with_one_line_and_whole_lines(
    micro_model_dir, digit_reward, tmpfs, capsys
):
    """16 KiB: config.yaml, the lock and a few steps' metrics. The step whose metrics find no
    room ends the run (exit 2) with one line, and every log keeps only whole lines."""
    run_dir = tmpfs("16k") / "run"
    steps = {"trainer.total_steps": 8, "checkpoint.every": 0}

    status = main(["train", *cli_args(micro_model_dir, digit_reward, run_dir, **steps)])

    said = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert status == 2 and len(said) == 1, said
    assert said[0].startswith(f"honing: error: cannot write {run_dir}/")
    assert "the disk is full (0.0 MiB free there); free some space" in said[0]
    for name in ("metrics.jsonl", "samples.jsonl", "events.jsonl"):
        text = (run_dir / name).read_text()
        assert text == "" or text.endswith("\n"), name
        [json.loads(line) for line in text.splitlines()]  # every line whole
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").open()]
    assert 0 < len(steps) < 9 and steps == list(range(len(steps)))


def test_an_event_that_finds_no_room_is_cut_off_whole(tmpfs):
    """``events.jsonl`` on a full disk: the event that does not fit leaves nothing of itself,
    the error is one line, and once there is room again the log goes on."""
    from honing.monitor import RunLogger

    disk = tmpfs("8k")
    filler = disk / "filler"
    logger = RunLogger(disk / "run", total_steps=1, tensorboard=False, console=False)
    filler.write_bytes(bytes(4096))
    logger.log_event("small", note="x" * 100)
    with pytest.raises(UserError) as raised:
        logger.log_event("large", note="y" * 8000)
    message = str(raised.value)
    assert message == (
        f"cannot write {disk / 'run' / 'events.jsonl'}: the disk is full (0.0 MiB free there); "
        "free some space, then resume with --resume auto"
    )
    filler.unlink()
    logger.log_event("after", note="z")
    logger.close()
    kinds = [json.loads(line)["kind"] for line in (disk / "run" / "events.jsonl").open()]
    assert kinds == ["small", "after"]
