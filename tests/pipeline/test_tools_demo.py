"""examples/arithmetic_tools.yaml (the tool demo) runs: its config with a micro model of
builtin:tiny-tools' kind (the tags as tokens, the tool corpus) in place of the built-in."""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from honing.backends.launch import train
from honing.config import build_config
from honing.config.sources import load_yaml
from honing.data import warmstart_corpus
from honing.models.tiny import TINY_TOOLS, build_tiny_model, tool_corpus

EXAMPLE = Path(__file__).parents[2] / "examples" / "arithmetic_tools.yaml"
SMALL = {
    "rollout.batch_size": 2,
    "rollout.group_size": 2,
    "rollout.val_samples": 1,
    "data.train_size": 20,
    "data.val_size": 4,
    "rollout.max_new_tokens": 32,
    "trainer.total_steps": 2,
    "trainer.val_every": 0,
    "monitor.console": False,
    "monitor.tensorboard": False,
}


@pytest.fixture(scope="module")
def micro_tools_model(tmp_path_factory) -> Path:
    """builtin:tiny-tools' spec at the micro model's size, on a small tool corpus."""
    micro = {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64}
    spec = replace(TINY_TOOLS, **micro, warmstart_steps=4, warmstart_batch=8)
    corpus = tool_corpus(warmstart_corpus(400, 0, 8, 0.7, min_digits=6), 0.3, seed=0)
    directory = tmp_path_factory.mktemp("tools-models")
    return build_tiny_model(directory, corpus, spec, log=lambda message: None)


def test_the_tool_demo_config_runs_two_steps(micro_tools_model, tmp_path):
    example = load_yaml(EXAMPLE)
    assert example["model.path"] == "builtin:tiny-tools"
    assert example["rollout.tools"] == ["calculator"]
    config = build_config(example, SMALL | {"model.path": str(micro_tools_model)})
    train(config, tmp_path / "run", log=lambda message: None)
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    metrics = [json.loads(line) for line in lines]
    assert [m["step"] for m in metrics if "tool/turns_per_sample" in m] == [1, 2]
    assert all(m["samples/generated"] == 4 for m in metrics if m["step"] >= 1)
    assert any("val/tool_calls_per_sample" in m for m in metrics)
