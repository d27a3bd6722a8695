"""load_prompts: verl's row schema in JSON lines and Parquet, and its error messages."""

import json

import pytest

from honing.data.datasets import load_prompts
from honing.errors import DataError
from honing.types import Prompt


def write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def row(**fields):
    return json.dumps(fields)


def test_string_prompt_with_reward_model(tmp_path):
    path = write_lines(
        tmp_path / "gsm.jsonl",
        [row(prompt="What is 2+3?", data_source="gsm8k", reward_model={"ground_truth": "5"})],
    )
    prompts, skipped = load_prompts([path])
    assert skipped == 0
    assert prompts == [
        Prompt(
            id="gsm.jsonl:1",
            prompt="What is 2+3?",
            ground_truth="5",
            data_source="gsm8k",
            extra_info={},
        )
    ]


def test_messages_prompt_defaults_and_conveniences(tmp_path):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
    ]
    path = write_lines(
        tmp_path / "chat.jsonl",
        [
            row(prompt=messages, ground_truth=4),
            "",
            row(prompt="3+3?", answer="6", extra_info={"index": 41, "split": "test"}),
        ],
    )
    prompts, skipped = load_prompts([path])
    assert skipped == 0
    first, second = prompts
    assert first.prompt == messages
    assert first.ground_truth == 4
    assert first.data_source == "chat"  # the file stem
    assert first.id == "chat.jsonl:1"
    assert second.id == "chat.jsonl:index=41"  # extra_info.index wins over the line number (3)
    assert second.ground_truth == "6"
    assert second.extra_info == {"index": 41, "split": "test"}


def test_parquet_rows_use_row_index(tmp_path):
    pyarrow = pytest.importorskip("pyarrow")
    parquet = pytest.importorskip("pyarrow.parquet")
    table = pyarrow.Table.from_pylist(
        [
            {
                "prompt": [{"role": "user", "content": "1+1?"}],
                "data_source": "toy",
                "reward_model": {"ground_truth": "2", "style": "rule"},
            },
            {
                "prompt": [{"role": "user", "content": "2+5?"}],
                "data_source": "toy",
                "reward_model": {"ground_truth": "7", "style": "rule"},
            },
        ]
    )
    path = tmp_path / "train.parquet"
    parquet.write_table(table, path)
    prompts, skipped = load_prompts([str(path)])
    assert skipped == 0
    assert [prompt.id for prompt in prompts] == ["train.parquet:0", "train.parquet:1"]
    assert prompts[1].prompt == [{"role": "user", "content": "2+5?"}]
    assert prompts[1].ground_truth == "7"
    assert prompts[1].data_source == "toy"


def test_json_array_file(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps([{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}]))
    prompts, _ = load_prompts([str(path)])
    assert [(prompt.id, prompt.ground_truth) for prompt in prompts] == [
        ("rows.json:0", "1"),
        ("rows.json:1", "2"),
    ]


def test_missing_file_names_the_path(tmp_path):
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match="data file not found: .*nope.jsonl"):
        load_prompts([missing])


def test_unknown_extension_lists_supported(tmp_path):
    path = tmp_path / "data.csv"
    path.write_text("prompt,answer\n")
    with pytest.raises(DataError, match=r"data\.csv.*\.jsonl, \.json, \.parquet"):
        load_prompts([str(path)])


def test_bad_json_line_reports_file_and_line(tmp_path):
    path = write_lines(
        tmp_path / "bad.jsonl",
        [row(prompt="a", answer="1"), row(prompt="b", answer="2"), '{"prompt": "c", '],
    )
    with pytest.raises(DataError) as info:
        load_prompts([path])
    message = str(info.value)
    assert message.startswith(f"{path}:3: invalid JSON")
    assert "expected" in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("bad_row", "reason"),
    [
        ({"answer": "1"}, "missing 'prompt'"),
        ({"prompt": 7, "answer": "1"}, "'prompt' is a int"),
        ({"prompt": [{"role": "user"}], "answer": "1"}, "prompt message 0 has no string 'content'"),
        ({"prompt": [{"content": "hi"}], "answer": "1"}, "prompt message 0 has no string 'role'"),
        ({"prompt": "hi"}, "missing ground truth"),
        ({"prompt": "hi", "reward_model": {"style": "rule"}}, "missing ground truth"),
        ({"prompt": "hi", "answer": "1", "extra_info": [1]}, "'extra_info' is a list"),
    ],
)
def test_malformed_rows_name_line_and_problem(tmp_path, bad_row, reason):
    path = write_lines(tmp_path / "rows.jsonl", [row(prompt="ok", answer="1"), json.dumps(bad_row)])
    with pytest.raises(DataError, match=f"rows.jsonl:2: {reason}"):
        load_prompts([path])


def test_skip_mode_counts_bad_rows(tmp_path):
    path = write_lines(
        tmp_path / "mixed.jsonl",
        [
            row(prompt="a", answer="1"),
            "not json",
            row(prompt="b"),
            row(prompt="c", answer="3"),
        ],
    )
    prompts, skipped = load_prompts([path], on_bad_row="skip")
    assert skipped == 2
    assert [prompt.id for prompt in prompts] == ["mixed.jsonl:1", "mixed.jsonl:4"]


def test_file_without_valid_rows_is_an_error(tmp_path):
    path = write_lines(tmp_path / "junk.jsonl", ["not json", "", "[1, 2]"])
    with pytest.raises(DataError, match="junk.jsonl: no valid rows"):
        load_prompts([path], on_bad_row="skip")


def test_duplicate_ids_are_rejected(tmp_path):
    path = write_lines(
        tmp_path / "dup.jsonl",
        [
            row(prompt="a", answer="1", extra_info={"index": 0}),
            row(prompt="b", answer="2", extra_info={"index": 0}),
        ],
    )
    with pytest.raises(DataError, match=r"dup.jsonl:2: duplicate prompt id 'dup.jsonl:index=0'"):
        load_prompts([path])


@pytest.mark.parametrize("on_bad_row", ["error", "skip"])
def test_rows_with_and_without_an_index_get_unique_ids(tmp_path, on_bad_row):
    # line 1's index 2 and line 2's line number are both 2: neither is a duplicate
    path = write_lines(
        tmp_path / "mix.jsonl",
        [
            row(prompt="a", answer="1", extra_info={"index": 2}),
            row(prompt="b", answer="2"),
            row(prompt="c", answer="3", extra_info={"index": 1}),
        ],
    )
    prompts, skipped = load_prompts([path], on_bad_row=on_bad_row)
    assert skipped == 0
    assert [p.id for p in prompts] == ["mix.jsonl:index=2", "mix.jsonl:2", "mix.jsonl:index=1"]


def test_several_files_keep_order(tmp_path):
    first = write_lines(tmp_path / "a.jsonl", [row(prompt="x", answer="1")])
    second = write_lines(tmp_path / "b.jsonl", [row(prompt="y", answer="2")])
    prompts, _ = load_prompts([first, second])
    assert [prompt.id for prompt in prompts] == ["a.jsonl:1", "b.jsonl:1"]


def test_bad_policy_is_rejected(tmp_path):
    with pytest.raises(DataError, match="on_bad_row"):
        load_prompts([], on_bad_row="ignore")
