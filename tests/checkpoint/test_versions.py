"""Tests for listing a run's checkpoints with their metrics (``honing checkpoints``)."""

import json

import torch
from safetensors.torch import load_file

from honing.backends.launch import train
from honing.checkpoint import CheckpointManager
from honing.checkpoint.versions import format_checkpoints, list_checkpoints
from tests.pipeline._configs import small_run_config


def write(payload: bytes):
    def fill(directory):
        (directory / "weights.bin").write_bytes(payload)

    return fill


def make_run(run_dir):
    manager = CheckpointManager(run_dir / "checkpoints", keep=5)
    for step in (2, 4, 6):
        manager.save(step, write(b"w" * 1000 * step))
    metrics = [
        {"step": 0, "val/accuracy": 0.25},
        *({"step": s, "critic/score/mean": s / 10} for s in range(1, 7)),
    ]
    metrics[4]["val/accuracy"] = 0.5  # validated at step 4
    lines = [json.dumps(m) for m in metrics] + ['{"step": 7, "critic/sco']  # a torn line
    (run_dir / "metrics.jsonl").write_text("\n".join(lines))
    return manager


def test_rows_join_checkpoints_and_metrics(tmp_path):
    make_run(tmp_path)
    (tmp_path / "checkpoints" / "step_6" / "weights.bin").write_bytes(b"short")
    (tmp_path / "checkpoints" / "step_8").mkdir()  # unfinished, never loadable

    rows = list_checkpoints(tmp_path)

    assert [row["step"] for row in rows] == [2, 4, 6, 8]
    assert [row["ok"] for row in rows] == [True, True, False, False]
    assert [row["last_good"] for row in rows] == [False, True, False, False]
    assert [row["size"] for row in rows] == [2000, 4000, 6000, None]
    assert [row["critic/score/mean"] for row in rows] == [0.2, 0.4, 0.6, None]
    # The latest validation at or before the step: step 0's for step 2, step 4's after.
    assert [row["val/accuracy"] for row in rows] == [0.25, 0.5, 0.5, 0.5]
    assert [row["val_step"] for row in rows] == [0, 4, 4, 4]
    assert rows[2]["problem"] == "weights.bin: 5 bytes, manifest says 6000"
    assert rows[3]["problem"].startswith("no COMPLETE marker")
    assert isinstance(rows[0]["time"], float) and rows[3]["time"] is None


def test_table_marks_the_last_good_one_and_says_what_is_wrong(tmp_path):
    make_run(tmp_path)
    (tmp_path / "checkpoints" / "step_6" / "weights.bin").write_bytes(b"short")

    lines = format_checkpoints(list_checkpoints(tmp_path)).splitlines()

    assert lines[0].split() == [
        "step",
        "saved",
        "size",
        "files",
        "critic/score/mean",
        "val/accuracy",
        "path",
    ]
    assert lines[1].split()[0] == "2" and "0.250 (step 0)" in lines[1]
    assert lines[2].startswith("*") and lines[2].split()[1] == "4"
    assert "0.400" in lines[2] and "0.500" in lines[2] and "(step" not in lines[2]
    assert "DAMAGED" in lines[3] and lines[3].endswith("(weights.bin: 5 bytes, manifest says 6000)")
    assert lines[-1] == "* the last good checkpoint: what --resume auto takes"


def test_no_checkpoints(tmp_path):
    assert list_checkpoints(tmp_path) == []
    assert format_checkpoints([]) == "no checkpoints"


def test_a_real_run_lists_its_versions_and_resumes_from_any(
    micro_model_dir, digit_reward, tmp_path
):
    config = small_run_config(
        micro_model_dir,
        digit_reward,
        **{"trainer.total_steps": 3, "checkpoint.every": 1, "checkpoint.keep": 3},
    )
    train(config, tmp_path / "run", log=lambda message: None)
    rows = list_checkpoints(tmp_path / "run")
    assert [(r["step"], r["ok"], r["last_good"]) for r in rows] == [
        (1, True, False),
        (2, True, False),
        (3, True, True),
    ]
    assert all(r["critic/score/mean"] is not None for r in rows)
    assert rows[0]["val/accuracy"] is not None and rows[0]["val_step"] == 0

    # --resume PATH from the first version redoes steps 2 and 3 exactly.
    final = load_file(tmp_path / "run" / "checkpoints" / "step_3" / "model.safetensors")
    train(config, tmp_path / "run", resume=rows[0]["path"], log=lambda message: None)
    again = load_file(tmp_path / "run" / "checkpoints" / "step_3" / "model.safetensors")
    assert all(torch.equal(final[name], again[name]) for name in final)
