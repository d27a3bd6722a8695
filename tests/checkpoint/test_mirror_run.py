"""A run mirrors every M-th checkpoint to a second directory and, its local checkpoints lost,
resumes from the mirror."""

import json
import shutil

from honing.backends.launch import train
from honing.checkpoint import verify
from tests.pipeline._configs import small_run_config


def test_a_run_resumes_from_its_mirror(micro_model_dir, digit_reward, tmp_path):
    archive = tmp_path / "archive"
    settings = {
        "checkpoint.every": 1,
        "checkpoint.keep": 1,
        "checkpoint.mirror_url": f"file://{archive}",
        "checkpoint.mirror_every": 2,
    }
    run_dir = tmp_path / "run"
    config = small_run_config(
        micro_model_dir, digit_reward, **settings, **{"trainer.total_steps": 3}
    )
    train(config, run_dir, log=lambda message: None)
    assert sorted(p.name for p in archive.iterdir()) == ["step_2"]
    assert verify(archive / "step_2") is None

    shutil.rmtree(run_dir / "checkpoints")  # the local tier is lost
    longer = small_run_config(
        micro_model_dir, digit_reward, **settings, **{"trainer.total_steps": 4}
    )
    train(longer, run_dir, resume="auto", log=lambda message: None)

    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    fetched = [e for e in events if e["kind"] == "checkpoint_from_mirror"]
    assert [e["step"] for e in fetched] == [2]
    resumed = [e for e in events if e["kind"] == "resumed"]
    assert resumed[-1]["step"] == 2 and resumed[-1]["checkpoint"] == fetched[0]["path"]
    assert sorted(p.name for p in archive.iterdir()) == ["step_2", "step_4"]
    mirrored = [e["step"] for e in events if e["kind"] == "checkpoint_mirrored"]
    assert mirrored == [2, 4]
