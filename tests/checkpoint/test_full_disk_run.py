"""A training run whose disk fills up: failed saves are reported and retried, the earlier
checkpoint stays loadable, and a failed final save stops the run with one line."""

import json
import subprocess

import pytest

from honing.backends.launch import train
from honing.checkpoint import verify
from honing.errors import UserError
from tests.pipeline._configs import small_run_config


@pytest.fixture
def small_disk(tmp_path):
    """A real 600 KiB tmpfs: room for one micro-model checkpoint (~350 KiB) and the logs."""
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip() or 'not permitted'}")
    yield mount_point
    subprocess.run(["umount", "--lazy", str(mount_point)], check=True)  # even if still open


def test_a_full_disk_mid_run(micro_model_dir, digit_reward, small_disk):
    config = small_run_config(
        micro_model_dir,
        digit_reward,
        **{"trainer.total_steps": 3, "checkpoint.every": 1, "checkpoint.keep": 1},
    )
    run_dir = small_disk / "run"

    with pytest.raises(UserError) as raised:
        train(config, run_dir, log=lambda message: None)

    message = str(raised.value)
    assert "\n" not in message
    assert f"could not save the checkpoint of step 3 under {run_dir / 'checkpoints'}" in message
    assert "the disk is full (0." in message and "MiB free there;" in message
    assert message.endswith("free some space, then resume with --resume auto")
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    failed = [e for e in events if e["kind"] == "checkpoint_failed"]
    assert [e["step"] for e in failed] == [2, 3]  # step 2 failed, the run went on to step 3
    assert all(e["disk_full"] and e["free_bytes"] < 1 << 20 for e in failed)
    # The checkpoint of step 1 is whole and nothing partial is left beside it.
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_1"]
    assert verify(run_dir / "checkpoints" / "step_1") is None
    steps = [
        json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps == [0, 1, 2, 3]
