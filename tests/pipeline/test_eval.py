"""``honing eval``: a checkpoint scores what its run logged at that step (same prompts, same
sampling), for a full checkpoint and for a LoRA one loaded as base + adapter."""

import json

import pytest

from honing import cli
from honing.backends.launch import train
from honing.errors import DataError
from honing.pipeline.evaluate import evaluate_model

from ._configs import small_run_config


@pytest.mark.parametrize("lora", [False, True])
def test_a_checkpoint_scores_what_its_run_logged(tmp_path, micro_model_dir, digit_reward, lora):
    if lora:
        pytest.importorskip("peft")
    extra = {"model.lora_rank": 4} if lora else {}
    config = small_run_config(
        micro_model_dir,
        digit_reward,
        **{"trainer.total_steps": 2, "checkpoint.every": 2, "trainer.lr": 1e-2} | extra,
    )
    train(config, tmp_path / "run", log=lambda m: None)
    last = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    checkpoint = tmp_path / "run" / "checkpoints" / "step_2"
    got = evaluate_model(config, str(checkpoint), log=lambda m: None)
    for key in ("val/accuracy", "val/pass@1", "val/mean@1"):
        assert got[key] == last[key], key
    assert got["val/prompts"] == 4


def test_the_command_prints_and_writes_the_metrics(tmp_path, micro_model_dir, capsys):
    out = tmp_path / "eval.json"
    args = ["eval", f"model.path={micro_model_dir}", "data.val_size=4", "rollout.val_samples=2"]
    assert cli.main(args + ["--model", str(micro_model_dir), "--output", str(out)]) == 0
    assert "val/accuracy:" in capsys.readouterr().out
    assert json.loads(out.read_text())["val/prompts"] == 4
    assert cli.main(["eval", "--model", str(tmp_path / "nowhere")]) == 2
    assert "nowhere" in capsys.readouterr().err


def test_a_damaged_checkpoint_is_refused(tmp_path, micro_model_dir, digit_reward, capsys):
    config = small_run_config(micro_model_dir, digit_reward, **{"trainer.total_steps": 1})
    train(config, tmp_path / "run", log=lambda m: None)
    checkpoint = tmp_path / "run" / "checkpoints" / "step_1"
    weights = checkpoint / "model.safetensors"
    data = bytearray(weights.read_bytes())
    for offset in range(len(data) - 16, len(data)):  # 16 flipped bytes in the last weights
        data[offset] ^= 0xFF
    weights.write_bytes(bytes(data))
    args = ["eval", f"model.path={micro_model_dir}", f"reward.function={digit_reward}"]
    assert cli.main(args + ["--model", str(checkpoint)]) == 2
    err = capsys.readouterr().err
    assert f"--model {checkpoint}: the checkpoint is damaged" in err
    assert "model.safetensors: sha256 differs from the manifest" in err


def test_a_model_directory_without_a_manifest_is_said_to_be_unchecked(micro_model_dir, capsys):
    args = ["eval", f"model.path={micro_model_dir}", "data.val_size=2", "rollout.val_samples=1"]
    assert cli.main(args + ["--model", str(micro_model_dir)]) == 0
    assert "has no manifest.json (not a honing checkpoint): its files are not checked" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize("on_bad_row", ["skip", "error"])
def test_an_over_long_validation_prompt_is_a_bad_row(tmp_path, micro_model_dir, on_bad_row):
    row = lambda text: json.dumps({"prompt": text, "reward_model": {"ground_truth": "2"}})  # noqa: E731
    (tmp_path / "val.jsonl").write_text(row("1+1=") + "\n" + row("9" * 600) + "\n")
    config = small_run_config(
        micro_model_dir,
        "math",
        **{
            "data.train_files": [str(tmp_path / "val.jsonl")],
            "data.val_files": [str(tmp_path / "val.jsonl")],
            "data.on_bad_row": on_bad_row,
            "rollout.max_seq_len": 64,
        },
    )
    said = []
    if on_bad_row == "error":
        with pytest.raises(DataError, match="val.jsonl:2: the prompt has 600 tokens"):
            evaluate_model(config, str(micro_model_dir), log=said.append)
        return
    got = evaluate_model(config, str(micro_model_dir), log=said.append)
    assert got["val/prompts"] == 1  # the long one skipped, and said so
    assert any("skipped_rows: count=1" in line for line in said)
