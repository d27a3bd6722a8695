"""Speculative decoding in a run: what validation's generation decides about speculation
(which carries over to training) reaches events.jsonl and the metrics."""

import json

from honing.backends.launch import train

from ._configs import small_run_config


def test_validation_turning_speculation_off_is_an_event_with_its_figures(
    tmp_path, micro_model_dir, digit_reward
):
    # An acceptance of 1.0 is out of the n-gram draft's reach: the step-0 validation turns
    # speculation off, and training starts without it.
    config = small_run_config(
        micro_model_dir,
        digit_reward,
        **{
            "rollout.speculative": "ngram",
            "rollout.spec_min_accept": 1.0,
            "rollout.max_new_tokens": 8,
            "trainer.total_steps": 1,
            "checkpoint.every": 0,
        },
    )
    run = tmp_path / "run"
    train(config, run, log=lambda message: None)
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    [off] = [e for e in events if e["kind"] == "speculation_off"]
    assert (off["step"], off["during"], off["min_accept"]) == (0, "validation", 1.0)
    assert 0 <= off["accept_rate"] < 1.0
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert metrics[0]["val/spec_accept_rate"] == off["accept_rate"]
    assert metrics[0]["val/spec_enabled"] == 1.0  # it speculated, then turned off
    assert metrics[1]["rollout/spec_enabled"] == 0.0
