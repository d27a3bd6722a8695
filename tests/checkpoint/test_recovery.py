"""Tests for damaged checkpoints, a full disk while saving, and the mirror tier."""

import errno
import os
import shutil
import subprocess
import threading
import time

import pytest

from honing.checkpoint import MANIFEST, CheckpointManager, CheckpointSaveError, verify
from honing.errors import UserError


def writer(payload: bytes):
    def write(directory):
        (directory / "weights.bin").write_bytes(payload)
        (directory / "nested").mkdir()
        (directory / "nested" / "state.json").write_text('{"ok": true}')

    return write


class Events(list):
    """Collects ``on_event`` calls as ``(kind, fields)``; ``mirror_waiting`` (whether an
    upload is still under way when the end comes depends on timing) is kept apart."""

    def __init__(self):
        super().__init__()
        self.waiting = []

    def __call__(self, kind, **fields):
        (self.waiting if kind == "mirror_waiting" else self).append((kind, fields))

    def kinds(self):
        return [kind for kind, _ in self]


def test_every_save_has_a_manifest_that_verifies(tmp_path):
    manager = CheckpointManager(tmp_path, keep=2)
    path = manager.save(1, writer(b"one"))
    assert (path / MANIFEST).is_file()
    assert verify(path) is None


def test_auto_skips_a_damaged_checkpoint_and_reports_it(tmp_path):
    events = Events()
    manager = CheckpointManager(tmp_path, keep=3, on_event=events)
    for step in (1, 2, 3):
        manager.save(step, writer(b"x" * step))
    (tmp_path / "step_3" / "weights.bin").write_bytes(b"y" * 3)  # same size, other bytes
    (tmp_path / "step_2" / "weights.bin").write_bytes(b"")  # cut short

    assert manager.resolve("auto") == tmp_path / "step_1"
    assert events.kinds() == ["checkpoint_corrupt", "checkpoint_corrupt", "checkpoint_verified"]
    assert events[0][1] == {
        "path": str(tmp_path / "step_3"),
        "tier": "local",
        "reason": "weights.bin: sha256 differs from the manifest",
    }
    assert events[1][1]["reason"] == "weights.bin: 0 bytes, manifest says 2"
    assert events[2][1]["path"] == str(tmp_path / "step_1")


def test_auto_with_only_damaged_checkpoints_starts_fresh(tmp_path):
    manager = CheckpointManager(tmp_path, keep=3)
    manager.save(1, writer(b"a"))
    (tmp_path / "step_1" / MANIFEST).unlink()
    assert manager.resolve("auto") is None


def test_resume_path_refuses_a_damaged_checkpoint_in_one_line(tmp_path):
    manager = CheckpointManager(tmp_path, keep=3)
    path = manager.save(1, writer(b"abc"))
    (path / "nested" / "state.json").unlink()
    with pytest.raises(UserError) as raised:
        manager.resolve(str(path))
    message = str(raised.value)
    assert "damaged (nested/state.json: missing)" in message and "\n" not in message


@pytest.fixture
def tiny_disk(tmp_path):
    """A real 200 KiB filesystem (tmpfs), so a large write fails with ENOSPC for real."""
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=200k", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip() or 'not permitted'}")
    yield mount_point
    subprocess.run(["umount", "--lazy", str(mount_point)], check=True)  # even if still open


def test_a_full_disk_keeps_the_previous_checkpoint(tiny_disk):
    events = Events()
    manager = CheckpointManager(tiny_disk / "checkpoints", keep=2, on_event=events)
    manager.save(1, writer(b"s" * 10_000))

    with pytest.raises(CheckpointSaveError) as raised:
        manager.save(2, writer(b"L" * 400_000))  # twice the disk

    message = str(raised.value)
    assert "step 2" in message and str(tiny_disk / "checkpoints") in message
    assert "the disk is full" in message and "No space left on device" in message
    assert raised.value.__cause__.errno == errno.ENOSPC
    assert sorted(os.listdir(tiny_disk / "checkpoints")) == ["step_1"]  # partial one removed
    assert verify(tiny_disk / "checkpoints" / "step_1") is None
    assert manager.resolve("auto") == tiny_disk / "checkpoints" / "step_1"
    (kind, fields) = events[0]
    assert kind == "checkpoint_failed" and fields["step"] == 2
    assert "No space left on device" in fields["reason"]
    # Room comes back: the next save works.
    assert manager.save(3, writer(b"s" * 10_000)) == tiny_disk / "checkpoints" / "step_3"


def test_a_failed_write_of_the_manifest_is_a_save_error_too(tmp_path, monkeypatch):
    manager = CheckpointManager(tmp_path, keep=2)
    manager.save(1, writer(b"one"))

    def no_room(directory):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("honing.checkpoint.manager.write_manifest", no_room)
    with pytest.raises(CheckpointSaveError, match="No space left"):
        manager.save(2, writer(b"two"))
    assert sorted(os.listdir(tmp_path)) == ["step_1"]


def test_a_bug_in_the_writer_is_not_taken_for_a_full_disk(tmp_path):
    manager = CheckpointManager(tmp_path, keep=2)

    def buggy(directory):
        raise KeyError("optimizer")

    with pytest.raises(KeyError):
        manager.save(1, buggy)
    assert os.listdir(tmp_path) == []


def test_every_mth_checkpoint_is_mirrored_and_kept(tmp_path):
    events = Events()
    archive = tmp_path / "archive"
    manager = CheckpointManager(
        tmp_path / "local", keep=1, mirror_url=f"file://{archive}", mirror_every=2, on_event=events
    )
    for step in range(1, 6):
        manager.save(step, writer(bytes([step]) * 100))
    assert manager.finish_uploads() == []

    # step 2 was gone locally (keep=1) before its upload ran: the staging links held it
    assert manager.complete_steps() == [5]
    assert manager.mirror.complete_steps() == [2, 4]
    assert sorted(os.listdir(archive)) == ["step_2", "step_4"]
    assert verify(archive / "step_4") is None
    assert (archive / "step_4" / "weights.bin").read_bytes() == bytes([4]) * 100
    assert events.kinds() == ["checkpoint_mirrored"] * 2
    assert [e[1]["bytes"] for e in events] == [_size(archive / f"step_{s}") for s in (2, 4)]
    assert os.listdir(tmp_path / "local") == ["step_5"]  # no staging directory left


def _size(folder):
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def test_the_mirror_keeps_its_newest_copies_and_reports_uploads_as_metrics(tmp_path):
    events = Events()
    archive = tmp_path / "archive"
    manager = CheckpointManager(
        tmp_path / "local", keep=1, mirror_url=str(archive), mirror_keep=2, on_event=events
    )
    assert manager.mirror_metrics() == {}
    for step in range(1, 5):
        manager.save(step, writer(bytes([step]) * 1000))
        manager.finish_uploads()  # one by one, so that each prune is seen
    assert manager.mirror.complete_steps() == [3, 4]
    assert [e[1]["pruned"] for e in events] == [[], [], [1], [2]]

    manager.save(5, writer(b"5" * 1000))
    deadline = time.monotonic() + 30
    while manager.archive.uploader.pending and time.monotonic() < deadline:
        time.sleep(0.01)
    metrics = manager.mirror_metrics()
    assert metrics["checkpoint/mirror_pending"] == 0 and metrics["checkpoint/mirror_failures"] == 0
    assert metrics["checkpoint/mirror_upload_mb"] * 2**20 == events[-1][1]["bytes"] > 1000
    assert (
        0
        < metrics["checkpoint/mirror_upload_s"]
        == pytest.approx(events[-1][1]["seconds"], abs=1e-3)
    )
    assert manager.mirror_metrics() == {
        "checkpoint/mirror_pending": 0.0,
        "checkpoint/mirror_failures": 0.0,
    }


def test_a_flaky_mirror_is_tried_again(tmp_path):
    events = Events()
    manager = CheckpointManager(
        tmp_path / "local", keep=3, mirror_url=str(tmp_path / "archive"), on_event=events
    )
    manager.archive.retry = (3, 0.0)
    push, calls = manager.mirror.push, []

    def flaky(local, step):
        calls.append(step)
        if len(calls) == 1:
            raise ConnectionResetError("the endpoint hung up")
        return push(local, step)

    manager.mirror.push = flaky
    manager.save(1, writer(b"one"))
    manager.finish_uploads()
    assert calls == [1, 1] and manager.mirror.complete_steps() == [1]
    assert events.kinds() == ["checkpoint_mirrored"] and events[0][1]["attempts"] == 2


def test_uploads_still_running_at_the_end_are_reported_and_the_local_copies_stand(tmp_path):
    events = Events()
    manager = CheckpointManager(
        tmp_path / "local", keep=3, mirror_url=str(tmp_path / "archive"), on_event=events
    )
    release = threading.Event()
    manager.mirror.push = lambda local, step: release.wait()  # an endpoint that never answers
    manager.save(1, writer(b"one"))
    manager.save(2, writer(b"two"))

    uploader = manager.archive.uploader
    assert manager.finish_uploads(timeout_s=0.2) == [1, 2]
    assert events.kinds() == ["mirror_unfinished"] and events[0][1]["steps"] == [1, 2]
    assert events.waiting[0][1]["uploads"] == 2
    release.set()
    uploader._thread.join(timeout=30)
    assert events.kinds() == ["mirror_unfinished"]  # an upload that ends late goes unreported
    assert manager.complete_steps() == [1, 2]
    assert sorted(os.listdir(tmp_path / "local")) == ["step_1", "step_2"]  # staging removed


def test_an_event_sink_that_raises_stops_no_upload(tmp_path):
    def closed_log(kind, **fields):
        raise ValueError("sink is closed")

    manager = CheckpointManager(
        tmp_path / "local", keep=3, mirror_url=str(tmp_path / "archive"), on_event=closed_log
    )
    for step in (1, 2):
        manager.save(step, writer(bytes([step])))
    assert manager.archive.uploader.close(timeout_s=30) == []
    assert manager.mirror.complete_steps() == [1, 2]


def test_a_rollback_takes_the_abandoned_copies_out_of_the_mirror(tmp_path):
    archive = tmp_path / "archive"
    manager = CheckpointManager(tmp_path / "local", keep=5, mirror_url=str(archive))
    for step in (1, 2, 3):
        manager.save(step, writer(bytes([step])))
    manager.abandon_mirror_after(1)  # the stretch after step 1 went bad
    manager.finish_uploads()
    assert manager.mirror.complete_steps() == [1]
    (archive / "step_5").mkdir()  # a push cut off before its marker
    manager.save(2, writer(b"new 2"))  # the new stretch
    manager.finish_uploads()
    assert sorted(os.listdir(archive)) == ["step_1", "step_2"]  # markerless copies deleted
    assert (archive / "step_2" / "weights.bin").read_bytes() == b"new 2"


def test_the_end_of_run_wait_covers_an_abandon_under_way(tmp_path):
    """A slow endpoint: the wait at the end returns only once the abandoned copies have
    lost their markers, not as soon as the queue is empty."""
    manager = CheckpointManager(tmp_path / "local", keep=5, mirror_url=str(tmp_path / "archive"))
    for step in (1, 2):
        manager.save(step, writer(bytes([step])))
    abandon = manager.mirror.abandon_after

    def slow_abandon(step):
        time.sleep(0.5)
        return abandon(step)

    manager.mirror.abandon_after = slow_abandon
    manager.abandon_mirror_after(1)
    assert manager.finish_uploads() == []
    assert manager.mirror.complete_steps() == [1]


def test_a_mirror_whose_copies_cannot_be_fetched_stops_the_resume(tmp_path):
    """Starting afresh would push over the mirror's copies: say what to fix instead."""
    archive = tmp_path / "archive"
    manager = CheckpointManager(tmp_path / "local", keep=3, mirror_url=str(archive))
    manager.save(1, writer(b"one"))
    manager.finish_uploads()
    shutil.rmtree(tmp_path / "local")
    (archive / "step_1" / "weights.bin").write_bytes(b"rot")
    with pytest.raises(UserError, match="none of the 1 copies in the mirror .* could be fetched"):
        manager.resolve("auto")


def test_auto_falls_back_to_the_mirror_when_the_local_tier_is_lost(tmp_path):
    events = Events()
    archive = tmp_path / "archive"
    manager = CheckpointManager(
        tmp_path / "local", keep=3, mirror_url=str(archive), mirror_every=2, on_event=events
    )
    for step in range(1, 4):
        manager.save(step, writer(bytes([step]) * 100))
    manager.finish_uploads()
    shutil.rmtree(tmp_path / "local")  # the node's disk is gone
    events.clear()

    chosen = manager.resolve("auto")

    assert chosen == tmp_path / "local" / "step_2"
    assert (chosen / "weights.bin").read_bytes() == bytes([2]) * 100
    assert verify(chosen) is None
    assert events.kinds() == ["checkpoint_verified", "checkpoint_from_mirror"]
    assert events[1][1]["source"] == str(archive / "step_2")


def test_a_damaged_or_unfinished_mirror_copy_is_skipped(tmp_path):
    events = Events()
    archive = tmp_path / "archive"
    manager = CheckpointManager(
        tmp_path / "local", keep=3, mirror_url=str(archive), mirror_every=1, on_event=events
    )
    for step in (1, 2, 3):
        manager.save(step, writer(bytes([step]) * 100))
    manager.finish_uploads()
    shutil.rmtree(tmp_path / "local")
    (archive / "step_3" / "COMPLETE").unlink()  # a push cut off before its marker
    (archive / "step_2" / "weights.bin").write_bytes(b"rot" * 33 + b"!")
    events.clear()

    assert manager.resolve("auto") == tmp_path / "local" / "step_1"
    assert events.kinds() == ["checkpoint_corrupt", "checkpoint_verified", "checkpoint_from_mirror"]
    assert events[0][1]["tier"] == "mirror"
    assert events[0][1]["reason"] == "ValueError: weights.bin: sha256 differs from the manifest"
    assert not [p for p in os.listdir(tmp_path / "local") if p.startswith(".tmp-")]


def test_a_failing_mirror_is_reported_and_the_local_checkpoint_stands(tmp_path):
    events = Events()
    blocker = tmp_path / "a_file"
    manager = CheckpointManager(
        tmp_path / "local", keep=2, mirror_url=str(blocker / "archive"), on_event=events
    )
    blocker.write_text("not a directory")  # made after the check of the URL at the start
    manager.archive.retry = (2, 0.0)  # two tries, no wait between them
    path = manager.save(1, writer(b"one"))
    assert manager.finish_uploads() == []
    assert verify(path) is None
    assert events.kinds() == ["mirror_failed"]
    assert events[0][1]["step"] == 1 and events[0][1]["reason"] and events[0][1]["attempts"] == 2
    assert manager.mirror_metrics() == {}  # finished: the next push starts a new uploader


def test_latest_good_at_most_a_step(tmp_path):
    manager = CheckpointManager(tmp_path, keep=5)
    for step in (2, 4, 6):
        manager.save(step, writer(b"w"))
    (tmp_path / "step_4" / "weights.bin").write_bytes(b"")
    assert manager.latest_good(at_most=5) == tmp_path / "step_2"
    assert manager.latest_good(at_most=1) is None
    assert manager.latest_good() == tmp_path / "step_6"
