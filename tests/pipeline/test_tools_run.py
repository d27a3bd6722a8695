"""Runs with tools (rollout.tools): the turn loop wraps the run's engines: in one process,
on every torchrun rank, with speculative decoding."""

import json

import pytest

from honing.backends.launch import train
from honing.errors import ConfigError

from ._configs import small_run_config

TOOLS = {"rollout.tools": ["calculator"], "rollout.max_new_tokens": 12}
ACCOUNTED = ("samples/trained", "samples/filtered", "samples/failed", "samples/stale")


def _accounted_steps(run_dir, count: int) -> list[dict]:
    """The run's ``count`` steps, each with its 6 samples accounted for."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    steps = [m for m in map(json.loads, lines) if m["step"] >= 1]
    assert [m["step"] for m in steps] == list(range(1, count + 1))
    for m in steps:
        assert m["samples/generated"] == sum(m[k] for k in ACCOUNTED) == 6
    return steps


def test_a_run_with_tools_samples_turn_by_turn(tagged_model_dir, digit_reward, tmp_path):
    """Three steps with the calculator, honing's engine inside the turn loop: every step
    logs the tool metrics and every sample is accounted for."""
    values = TOOLS | {"trainer.total_steps": 3, "trainer.val_at_start": False}
    train(small_run_config(tagged_model_dir, digit_reward, **values), tmp_path / "run", log=print)
    for m in _accounted_steps(tmp_path / "run", 3):
        assert m["tool/turns_per_sample"] >= 1


@pytest.mark.parametrize("kind", ["ngram", "mtp"])
def test_speculated_turns_stop_at_the_tool_call(tagged_model_dir, digit_reward, tmp_path, kind):
    """Speculative decoding inside the turn loop: a drafted turn ends at the closing tag
    (tests/rollout/test_speculative.py holds the cut); two steps, every sample accounted for,
    the heads trained (mtp) on the turns."""
    values = TOOLS | {"trainer.total_steps": 2, "trainer.val_at_start": False}
    values |= {"rollout.speculative": kind, "rollout.spec_min_accept": 0.0}
    train(small_run_config(tagged_model_dir, digit_reward, **values), tmp_path / "run", log=print)
    for m in _accounted_steps(tmp_path / "run", 2):
        assert m["tool/turns_per_sample"] >= 1 and "rollout/spec_enabled" in m
        assert kind != "mtp" or "mtp/loss" in m


@pytest.mark.slow
def test_two_ranks_each_run_the_turns_of_their_share(tagged_model_dir, digit_reward, tmp_path):
    """Under torchrun (FSDP) each rank runs the turn loop on its share of every generate call
    (the tasks dealt to both ranks): two steps, every sample accounted for, the ranks' tool
    metrics merged into the step's."""
    import subprocess

    from tests import warm

    from ._configs import cli_args

    values = TOOLS | {"trainer.total_steps": 2, "trainer.val_at_start": False}
    values |= {"trainer.strategy": "fsdp", "pipeline.rollout_chunk": 1, "trainer.threads": 1}
    values["rollout.tools"] = "[calculator]"
    args = cli_args(tagged_model_dir, digit_reward, tmp_path / "run", **values)
    result = subprocess.run(warm.torchrun(2, "train", *args), capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    for m in _accounted_steps(tmp_path / "run", 2):
        assert m["rollout/generation_ranks"] == 2.0
        assert m["tool/samples"] == 6 and m["tool/turns_per_sample"] >= 1


def test_the_ranks_tool_metrics_merge_by_the_samples_behind_them():
    from honing.rollout.native.speculative import merge_metrics

    one = {"tool/samples": 2.0, "tool/calls": 2.0, "tool/errors": 1.0, "tool/timeouts": 0.0}
    one |= {"tool/calls_per_sample": 1.0, "tool/turns_per_sample": 2.0, "tool/latency_s": 0.5}
    two = {"tool/samples": 6.0, "tool/calls": 0.0, "tool/errors": 0.0, "tool/timeouts": 0.0}
    two |= {"tool/calls_per_sample": 0.0, "tool/turns_per_sample": 1.0, "tool/latency_s": 0.0}
    one["tool/hung_threads"], two["tool/hung_threads"] = 0.0, 3.0
    merged = merge_metrics([one, two, {"rollout/gen_timeouts": 1.0}])
    assert merged["tool/samples"] == 8 and merged["tool/calls"] == 2
    assert merged["tool/calls_per_sample"] == 0.25
    assert merged["tool/turns_per_sample"] == (2 * 2 + 6 * 1) / 8
    assert merged["tool/latency_s"] == 0.5 and merged["tool/hung_threads"] == 3
    assert merged["rollout/gen_timeouts"] == 1


def test_a_tokenizer_without_the_closing_tag_as_one_token_is_one_line(
    micro_model_dir, digit_reward, tmp_path
):
    cfg = small_run_config(micro_model_dir, digit_reward, **TOOLS | {"trainer.total_steps": 1})
    with pytest.raises(ConfigError, match="a turn ends at one token"):
        train(cfg, tmp_path / "run", log=lambda message: None)
