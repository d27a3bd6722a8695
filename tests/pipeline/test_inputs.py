"""What a run reads before it trains: an over-long prompt is a bad row like any other (skipped
and counted under ``data.on_bad_row=skip``), and a batch larger than the training set is
refused with one line before anything is written."""

import json

import pytest

from honing.cli import main
from honing.errors import DataError
from honing.models.loading import load_tokenizer
from honing.pipeline.components import build_components
from honing.pipeline.inputs import keep_tokenized, tokenize_prompts
from honing.types import Prompt

from ._configs import small_run_config

LONG = "9" * 600  # far over the max_seq_len of 64 below


def rows_file(path, prompts, bad_lines=()):
    rows = [json.dumps({"prompt": p, "answer": "2"}) for p in prompts]
    path.write_text("\n".join([*rows, *bad_lines]) + "\n")
    return str(path)


def prompt(number: int, text: str) -> Prompt:
    return Prompt(id=f"t.jsonl:{number}", prompt=text, ground_truth="2", origin=f"t.jsonl:{number}")


def test_an_over_long_prompt_names_its_line_or_is_left_out(micro_model_dir):
    tokenizer = load_tokenizer(micro_model_dir)
    prompts = [prompt(1, "1+1="), prompt(2, LONG)]
    with pytest.raises(DataError, match=r"^t.jsonl:2: the prompt has \d+ tokens, not less than"):
        tokenize_prompts(prompts, tokenizer, 64)
    rendered, ids = tokenize_prompts(prompts, tokenizer, 64, on_bad_row="skip")
    assert list(ids) == list(rendered) == ["t.jsonl:1"]
    train, val, skipped = keep_tokenized(prompts, [], 3, ids)
    assert (train, val, skipped) == ([prompts[0]], [], 4)
    with pytest.raises(DataError, match="every validation prompt is at least"):
        keep_tokenized(prompts[:1], prompts[1:], 0, ids)


def test_a_run_under_skip_leaves_the_long_prompt_out_and_counts_it(tmp_path, micro_model_dir):
    train = rows_file(tmp_path / "train.jsonl", ["1+1=", LONG, "2+0="], ["{not json"])
    val = rows_file(tmp_path / "val.jsonl", ["0+2=", LONG])
    config = small_run_config(
        micro_model_dir,
        "numeric",
        **{
            "data.train_files": [train],
            "data.val_files": [val],
            "data.on_bad_row": "skip",
            "rollout.max_seq_len": 64,
        },
    )
    parts = build_components(config, log=lambda message: None)
    assert [p.prompt for p in parts.train_prompts] == ["1+1=", "2+0="]
    assert [p.prompt for p in parts.val_prompts] == ["0+2="]
    assert parts.skipped_rows == 3  # the malformed line and the two long prompts
    assert set(parts.prompt_ids) == {p.id for p in parts.train_prompts + parts.val_prompts}


def test_a_batch_larger_than_the_training_set_is_one_line(tmp_path, micro_model_dir, capsys):
    out = tmp_path / "out"
    argv = [
        "train",
        f"model.path={micro_model_dir}",
        "data.train_size=3",
        "rollout.batch_size=4",
        "rollout.group_size=2",
        "data.val_size=2",
        "trainer.total_steps=1",  # what a run would be, had it started
        "monitor.console=false",
        "--output-dir",
        str(out),
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "rollout.batch_size=4 is more than the 3 training prompts" in err[0]
    assert not out.exists()
