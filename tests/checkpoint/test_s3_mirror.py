"""Checkpoints mirrored to a real S3 API (moto's server on loopback, through s3fs): uploads
in the background, the mirror's own retention, resuming on a machine whose run directory is
gone, and an endpoint that dies mid-run."""

import json
import os
import shutil
import signal
import subprocess
import threading
import time

import fsspec
import pytest
import torch
from safetensors.torch import load_file

from honing.backends.launch import train
from tests import warm
from tests.pipeline._configs import cli_args, small_run_config
from tests.s3_server import S3Server

pytestmark = pytest.mark.slow


@pytest.fixture
def s3(monkeypatch):
    server = S3Server()
    for name, value in server.env.items():
        monkeypatch.setenv(name, value)
    yield server
    server.kill()


def events_of(run_dir):
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def steps_of(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [m for m in map(json.loads, lines) if "actor/pg_loss" in m]


def final_weights(run_dir, step):
    return load_file(run_dir / "checkpoints" / f"step_{step}" / "model.safetensors")


def test_a_run_lost_with_its_disk_resumes_from_s3_to_the_same_weights(
    s3, micro_model_dir, digit_reward, tmp_path
):
    mirror = {
        "checkpoint.every": 1,
        "checkpoint.keep": 1,
        "checkpoint.mirror_url": "s3://honing-runs/run",
        "checkpoint.mirror_every": 2,
        "checkpoint.mirror_keep": 1,
    }
    steps = {"trainer.total_steps": 4}
    whole = tmp_path / "whole"
    train(small_run_config(micro_model_dir, digit_reward, **steps), whole, log=lambda m: None)

    run_dir = tmp_path / "run"
    first = small_run_config(micro_model_dir, digit_reward, **mirror, **{"trainer.total_steps": 2})
    train(first, run_dir, log=lambda message: None)
    s3fs = fsspec.filesystem("s3", skip_instance_cache=True)
    assert sorted(s3fs.ls("honing-runs/run")) == ["honing-runs/run/step_2"]
    [uploaded] = [e for e in events_of(run_dir) if e["kind"] == "checkpoint_mirrored"]
    assert uploaded["step"] == 2 and uploaded["bytes"] > 0

    shutil.rmtree(run_dir)  # a new machine: nothing of the run is left but the mirror
    resumed = small_run_config(micro_model_dir, digit_reward, **mirror, **steps)
    train(resumed, run_dir, log=lambda message: None)

    events = events_of(run_dir)
    fetched = [e for e in events if e["kind"] == "checkpoint_from_mirror"]
    assert [e["step"] for e in fetched] == [2]
    assert [e["step"] for e in events if e["kind"] == "resumed"] == [2]
    verified = [e for e in events if e["kind"] == "checkpoint_verified"]
    assert verified[0]["tier"] == "mirror"  # the manifest's sha256 checked before loading
    for name, tensor in final_weights(whole, 4).items():
        assert torch.equal(final_weights(run_dir, 4)[name], tensor), name
    # mirror_keep=1: the copy of step 4 replaced that of step 2
    s3fs.invalidate_cache()
    assert sorted(s3fs.ls("honing-runs/run")) == ["honing-runs/run/step_4"]
    mirrored = [e for e in events if e["kind"] == "checkpoint_mirrored"]
    assert [(e["step"], e["pruned"]) for e in mirrored] == [(4, [2])]


def test_an_endpoint_that_dies_mid_run_never_stops_training(
    s3, micro_model_dir, digit_reward, tmp_path
):
    """The S3 server is killed once the first upload is in; training finishes, every later
    upload is a ``mirror_failed`` event after its tries, and the local checkpoints stand."""
    run_dir = tmp_path / "run"
    values = {
        "checkpoint.every": 1,
        "checkpoint.keep": 2,
        "checkpoint.mirror_url": "s3://honing-runs/dies",
        "checkpoint.mirror_retries": 1,
        "trainer.total_steps": 5,
    }

    def kill_after_the_first_upload():
        events = run_dir / "events.jsonl"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if events.exists() and "checkpoint_mirrored" in events.read_text():
                s3.kill()
                return
            time.sleep(0.02)

    killer = threading.Thread(target=kill_after_the_first_upload)
    killer.start()
    lines = []
    train(small_run_config(micro_model_dir, digit_reward, **values), run_dir, log=lines.append)
    killer.join()

    assert len(steps_of(run_dir)) == 5
    events = events_of(run_dir)
    mirrored = [e["step"] for e in events if e["kind"] == "checkpoint_mirrored"]
    failed = [e for e in events if e["kind"] == "mirror_failed"]
    assert mirrored and failed and mirrored[-1] < 5
    assert sorted(mirrored + [e["step"] for e in failed]) == [1, 2, 3, 4, 5]
    assert all("Could not connect" in e["reason"] for e in failed)
    # every try of the first that failed, then one try each: the mirror is down
    assert [e["attempts"] for e in failed] == [2] + [1] * (len(failed) - 1)
    steps = ", ".join(str(e["step"]) for e in failed)
    assert lines[-1] == (
        f"checkpoint.mirror_url=s3://honing-runs/dies: {len(failed)} of 5 uploads failed "
        f"(steps {steps}; the last: {failed[-1]['reason']}); the local checkpoints stand "
        "(events.jsonl: mirror_failed, mirror_unfinished)"
    )
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_4", "step_5"]
    failures = sum(m.get("checkpoint/mirror_failures", 0) for m in steps_of(run_dir))
    assert failures <= len(failed)  # the last ones end after the last step's metrics


def test_the_mirror_check_writes_a_probe_and_a_dead_endpoint_fails_it(s3):
    """``honing doctor``'s row for ``checkpoint.mirror_url``."""
    from honing.checkpoint.mirror import Mirror

    mirror = Mirror("s3://honing-runs/probe")
    with pytest.raises(FileNotFoundError, match="bucket does not exist"):
        mirror.check()  # a bucket is not made by a check: a typo would be
    mirror.fs.mkdir("honing-runs")
    assert mirror.check() == "s3://honing-runs/probe writable (empty)"
    assert mirror.fs.find("honing-runs/probe") == []  # the probe is gone
    s3.kill()
    with pytest.raises(Exception, match="Could not connect"):
        Mirror("s3://honing-runs/probe").check()


def test_an_unreachable_bucket_is_an_error_not_a_fresh_start(s3, tmp_path):
    """A bucket URL with no prefix too: s3fs's exists() answers False for a bucket it cannot
    reach, which must not read as an empty mirror."""
    from honing.checkpoint import CheckpointManager
    from honing.errors import UserError

    s3.kill()
    for url in ("s3://honing-runs", "s3://honing-runs/run"):
        manager = CheckpointManager(tmp_path / "local", keep=2, mirror_url=url)
        with pytest.raises(UserError, match="cannot be read .*Could not connect"):
            manager.resolve("auto")


def wait_for(condition, what, timeout_s=120):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
        time.sleep(0.02)


def test_sigterm_during_the_wait_for_uploads_gives_them_their_grace(
    s3, micro_model_dir, digit_reward, tmp_path
):
    """The S3 server stops answering (SIGSTOP) once the run has started, so the uploads hang
    and the run's end waits for them. SIGTERM then does not cut the wait short: the server
    answers again a second later, the uploads complete within the grace, and the run exits
    143 with no staging directory left."""
    run_dir = tmp_path / "run"
    settings = {
        "trainer.total_steps": 2,
        "checkpoint.every": 1,
        "checkpoint.mirror_url": "s3://honing-runs/term",
    }
    args = cli_args(micro_model_dir, digit_reward, run_dir, **settings)
    with (tmp_path / "stderr").open("w") as stderr:
        run = subprocess.Popen(warm.honing("train", *args), stderr=stderr, text=True)
    try:
        wait_for(lambda: (run_dir / "config.yaml").exists(), "start")  # the mirror was listed
        os.kill(s3.process.pid, signal.SIGSTOP)
        wait_for(lambda: "mirror_waiting" in _text(run_dir / "events.jsonl"), "end of training")
        run.send_signal(signal.SIGTERM)
        terminated = time.monotonic()
        time.sleep(1.0)
        os.kill(s3.process.pid, signal.SIGCONT)
        run.wait(timeout=120)
    finally:
        os.kill(s3.process.pid, signal.SIGCONT)
        if run.poll() is None:
            run.kill()

    assert run.returncode == 143, (tmp_path / "stderr").read_text()
    assert time.monotonic() - terminated >= 1.0
    events = events_of(run_dir)
    assert sorted(e["step"] for e in events if e["kind"] == "checkpoint_mirrored") == [1, 2]
    assert "mirror_unfinished" not in [e["kind"] for e in events]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_1", "step_2"]


def _text(path):
    return path.read_text() if path.exists() else ""


def test_the_grace_ends_with_what_is_unfinished_reported_and_staging_removed(s3, tmp_path):
    """SIGTERM during the end-of-run wait on uploads that cannot end (the server stopped):
    after the grace they are a ``mirror_unfinished`` event, their staging directories are
    gone, and the interrupt goes on."""
    from honing.checkpoint import CheckpointManager
    from honing.cli import stop_on_sigterm
    from honing.errors import Terminated

    events = []
    local = tmp_path / "local"
    manager = CheckpointManager(
        local,
        keep=3,
        mirror_url="s3://honing-runs/grace",
        on_event=lambda kind, **fields: events.append((kind, fields)),
    )
    manager.check_mirror()
    os.kill(s3.process.pid, signal.SIGSTOP)
    for step in (1, 2):
        manager.save(step, lambda directory: (directory / "weights.bin").write_bytes(b"w" * 100))

    started = time.monotonic()  # before the timer: its 0.3 s count from here at the latest
    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
    with stop_on_sigterm(), pytest.raises(Terminated):
        manager.finish_uploads(timeout_s=600, grace_s=1.0)
    elapsed = time.monotonic() - started

    assert 1.3 <= elapsed < 10
    assert [kind for kind, _ in events] == ["mirror_waiting", "mirror_unfinished"]
    assert events[1][1]["steps"] == [1, 2]
    assert sorted(os.listdir(local)) == ["step_1", "step_2"]  # no .tmp-mirror-* left
    assert "did not finish (steps 1, 2)" in manager.mirror_outcome()
