"""The shipped examples stay valid: every config resolves and passes the run's cross-field
rules (at the torchrun world size it is written for), the GSM8K converter's rows load."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from honing.config import resolve_config
from honing.data import load_prompts
from honing.pipeline.rules import check_config

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_example_config_resolves(path):
    config = resolve_config(str(path), [], environ={})
    assert config.trainer.total_steps > 0
    ranks = 4 if config.trainer.sequence_parallel > 1 else 1  # as its comment launches it
    check_config(config, ranks)


def test_gsm8k_converter_output_is_valid_row_schema(tmp_path):
    source = tmp_path / "gsm8k.jsonl"
    rows = [
        {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3+4=7\n#### 7"},
        {"question": "A big number?", "answer": "so\n#### 1,234"},
    ]
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    target = tmp_path / "rows.jsonl"
    script = EXAMPLES / "gsm8k_to_jsonl.py"
    subprocess.run([sys.executable, str(script), str(source), str(target)], check=True)
    prompts, skipped = load_prompts([str(target)])
    assert skipped == 0
    assert [p.ground_truth for p in prompts] == ["7", "1234"]
    assert prompts[0].prompt[0]["role"] == "user"
    assert prompts[0].data_source == "gsm8k"
