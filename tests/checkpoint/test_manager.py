"""Tests for CheckpointManager: atomic publish, retention, crash leftovers, --resume."""

import json

import pytest

from honing.checkpoint import MARKER, CheckpointManager, read_marker
from honing.errors import UserError


def writer(text):
    """A checkpoint writer that stores ``text`` in a file and a nested file."""

    def write(directory):
        (directory / "state.txt").write_text(text, encoding="utf-8")
        (directory / "model").mkdir()
        (directory / "model" / "weights.bin").write_bytes(text.encode())

    return write


def names(root):
    return sorted(path.name for path in root.iterdir())


def test_save_publishes_a_complete_checkpoint(tmp_path):
    manager = CheckpointManager(tmp_path / "checkpoints", keep=3)
    path = manager.save(4, writer("four"))

    assert path == tmp_path / "checkpoints" / "step_4"
    assert (path / "state.txt").read_text(encoding="utf-8") == "four"
    assert (path / "model" / "weights.bin").read_bytes() == b"four"
    marker = json.loads((path / MARKER).read_text(encoding="utf-8"))
    assert marker["step"] == 4 and isinstance(marker["time"], float)
    assert read_marker(path) == marker
    assert names(tmp_path / "checkpoints") == ["step_4"]


def test_retention_keeps_the_newest(tmp_path):
    manager = CheckpointManager(tmp_path, keep=2)
    for step in range(1, 6):
        manager.save(step, writer(f"s{step}"))

    assert manager.complete_steps() == [4, 5]
    assert names(tmp_path) == ["step_4", "step_5"]
    assert manager.latest() == tmp_path / "step_5"


def test_retention_never_deletes_the_checkpoint_just_saved(tmp_path):
    manager = CheckpointManager(tmp_path, keep=1)
    manager.save(9, writer("future"))
    manager.save(5, writer("resumed branch"))
    assert manager.complete_steps() == [5, 9]


def test_failing_writer_leaves_nothing(tmp_path):
    manager = CheckpointManager(tmp_path, keep=2)

    def broken(directory):
        (directory / "half.bin").write_bytes(b"partial")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        manager.save(3, broken)
    assert names(tmp_path) == []
    assert manager.latest() is None


def test_failing_writer_keeps_the_previous_checkpoint_of_that_step(tmp_path):
    manager = CheckpointManager(tmp_path, keep=2)
    manager.save(3, writer("good"))

    def broken(directory):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        manager.save(3, broken)
    assert names(tmp_path) == ["step_3"]
    assert (tmp_path / "step_3" / "state.txt").read_text(encoding="utf-8") == "good"


def test_save_overwrites_an_existing_step(tmp_path):
    manager = CheckpointManager(tmp_path, keep=2)
    manager.save(3, writer("old"))
    (tmp_path / "step_3" / "stale_only_in_old.txt").write_text("x", encoding="utf-8")
    path = manager.save(3, writer("new"))

    assert (path / "state.txt").read_text(encoding="utf-8") == "new"
    assert not (path / "stale_only_in_old.txt").exists()
    assert names(tmp_path) == ["step_3"]


def test_crash_leftovers_are_ignored_and_reported(tmp_path):
    manager = CheckpointManager(tmp_path, keep=5)
    manager.save(3, writer("s3"))
    manager.save(5, writer("s5"))
    torn = tmp_path / ".tmp-step_7-x"
    torn.mkdir()
    (torn / "state.txt").write_text("half", encoding="utf-8")
    unmarked = tmp_path / "step_9"
    unmarked.mkdir()
    (tmp_path / "notes.txt").write_text("not a checkpoint", encoding="utf-8")

    assert manager.latest() == tmp_path / "step_5"
    assert manager.complete_steps() == [3, 5]
    assert manager.incomplete() == [torn, unmarked]

    assert manager.cleanup_incomplete() == [torn]
    assert not torn.exists()
    assert unmarked.exists()
    assert manager.incomplete() == [unmarked]


def test_latest_orders_steps_numerically(tmp_path):
    manager = CheckpointManager(tmp_path, keep=3)
    for step in (9, 10, 100):
        manager.save(step, writer(str(step)))
    assert manager.latest() == tmp_path / "step_100"


def test_empty_or_missing_root(tmp_path):
    manager = CheckpointManager(tmp_path / "absent", keep=1)
    assert manager.latest() is None
    assert manager.complete_steps() == []
    assert manager.incomplete() == []
    assert manager.cleanup_incomplete() == []
    assert manager.resolve("auto") is None


def test_keep_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="keep"):
        CheckpointManager(tmp_path, keep=0)


def test_resolve_never_and_auto(tmp_path):
    manager = CheckpointManager(tmp_path, keep=2)
    manager.save(1, writer("one"))
    manager.save(2, writer("two"))
    assert manager.resolve("never") is None
    assert manager.resolve("auto") == tmp_path / "step_2"


def test_resolve_a_complete_path(tmp_path):
    manager = CheckpointManager(tmp_path / "checkpoints", keep=2)
    manager.save(1, writer("one"))
    manager.save(2, writer("two"))
    chosen = tmp_path / "checkpoints" / "step_1"
    assert manager.resolve(str(chosen)) == chosen


def test_resolve_rejects_an_incomplete_path(tmp_path):
    manager = CheckpointManager(tmp_path, keep=2)
    (tmp_path / "step_9").mkdir()

    with pytest.raises(UserError) as raised:
        manager.resolve(str(tmp_path / "step_9"))
    message = str(raised.value)
    assert str(tmp_path / "step_9") in message
    assert "not a complete checkpoint" in message
    assert "\n" not in message


def test_resolve_rejects_a_missing_path(tmp_path):
    manager = CheckpointManager(tmp_path, keep=2)
    with pytest.raises(UserError, match="not a complete checkpoint .does not exist"):
        manager.resolve(str(tmp_path / "nowhere"))
