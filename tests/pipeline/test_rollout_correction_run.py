"""Rollout correction in a run: its config rules, and ``honing train`` logging its diagnostics
and rejecting tokens (top-k sampling makes the engine's logprobs differ from the trainer's:
mu is renormalised over the k most likely tokens, so rho = pi_old / mu < 1)."""

import json

import pytest

from honing.cli import main
from honing.config import build_config
from honing.errors import ConfigError
from honing.pipeline.rollout_engines import logprob_pass
from honing.pipeline.rules import check_config, rollout_correction

from ._configs import cli_args


@pytest.mark.parametrize(
    ("values", "error"),
    [
        (
            {"rollout_is": "token", "tis_level": "token"},
            "algorithm.tis_level / tis_cap and algorithm.rollout_is / rollout_rs both weigh",
        ),
        ({"rollout_rs": "seq_mean_k3", "rollout_rs_threshold": "0.1", "tis_cap": 1.5}, "tis_cap"),
        ({"rollout_is_batch_normalize": True}, "have no effect without algorithm.rollout_is"),
        ({"rollout_is_threshold": "3.0"}, "have no effect without algorithm.rollout_is"),
        ({"rollout_is": "token", "rollout_is_threshold": "2_1"}, "rollout_is_threshold: '2_1'"),
        ({"rollout_rs": "token_k1"}, "rollout_rs and rollout_rs_threshold go together"),
        ({"rollout_rs_threshold": "2.0"}, "rollout_rs and rollout_rs_threshold go together"),
        (
            {"rollout_rs": "token_k2,seq_sum_k9", "rollout_rs_threshold": "1"},
            "algorithm.rollout_rs / rollout_rs_threshold: 'seq_sum_k9' is not known",
        ),
    ],
)
def test_config_rules(values, error):
    config = build_config({f"algorithm.{key}": value for key, value in values.items()})
    with pytest.raises(ConfigError, match=error):
        check_config(config)


def test_settings_from_the_config():
    assert rollout_correction(build_config({})) is None
    values = {"rollout_is": "sequence", "rollout_is_threshold": "0.5_2.0", "tis_level": "none"}
    values |= {"rollout_rs": "token_k1", "rollout_rs_threshold": 1.5}  # YAML gives a float
    config = build_config({f"algorithm.{key}": value for key, value in values.items()})
    settings = rollout_correction(config)
    assert (settings.level, settings.lower, settings.upper) == ("sequence", 0.5, 2.0)
    [rejection] = settings.rejections
    assert (rejection.lower, rejection.upper) == pytest.approx((1 / 1.5, 1.5))
    assert settings.needs_whole_batch
    # an engine with weights of its own then costs a logprob pass per batch
    assert "rollout correction" in logprob_pass(config)
    assert logprob_pass(build_config({"algorithm.rollout_is": "token"})) == ""


def test_honing_train_logs_the_diagnostics_and_rejects(tmp_path, micro_model_dir, digit_reward):
    """Sequence-level weights, batch-normalised, and two rejection options. The micro model
    is nearly flat, so top-3 sampling gives every token about the same rho (~1/5): k1 bounds
    on mu / pi_old of [4, 6] keep every token, while the sum of k3 over a response grows with
    its length, so a bound of 1.2 rejects the responses longer than one token. Every step
    logs the diagnostics, the weights and the rejected shares; the separate old pass runs,
    as rejection needs the whole batch's token count."""
    run = tmp_path / "run"
    overrides = {
        "trainer.total_steps": 2,
        "trainer.val_at_start": False,
        "checkpoint.every": 0,
        "rollout.top_k": 3,
        "algorithm.rollout_is": "sequence",
        "algorithm.rollout_is_batch_normalize": True,
        "algorithm.rollout_rs": "token_k1,seq_sum_k3",
        "algorithm.rollout_rs_threshold": "4_6,1.2",
    }
    assert main(["train", *cli_args(micro_model_dir, digit_reward, run, **overrides)]) == 0
    lines = (run / "metrics.jsonl").read_text().splitlines()
    steps = [m for m in map(json.loads, lines) if "samples/generated" in m]
    assert len(steps) == 2
    for m in steps:
        assert "timing_s/old" in m
        assert m["rollout_corr/kl"] > 0 and m["rollout_corr/k3_kl"] > 0  # log mu > log pi_old
        assert m["rollout_corr/rollout_is_max"] < 1.0  # prod rho < 1 under top-k
        assert 0 < m["rollout_corr/rollout_is_eff_sample_size"] < 1
        assert m["rollout_corr/rollout_is_batch_norm_factor"] > 0
        assert m["rollout_corr/rollout_rs_token_k1_masked_fraction"] == 0
        assert 0 < m["rollout_corr/rollout_rs_seq_sum_k3_seq_masked_fraction"] < 1
        total = m["rollout_corr/rollout_rs_masked_fraction"]
        assert total == m["rollout_corr/rollout_rs_seq_sum_k3_masked_fraction"] > 0
        for name in ("chi2_token", "chi2_seq", "training_ppl", "rollout_ppl", "log_ppl_diff"):
            assert f"rollout_corr/{name}" in m
