"""KL to the reference as a per-token reward penalty, with a fixed or adaptive coefficient."""

import json

import pytest
import torch

from honing.backends.launch import train
from honing.config import build_config
from honing.errors import ConfigError
from honing.pipeline.experience import token_level_rewards
from honing.pipeline.rules import check_config

from ._configs import small_run_config

NO_LOG = lambda message: None  # noqa: E731


def run(tmp_path, model_dir, reward, **overrides):
    specific = {
        "trainer.total_steps": 3,
        "trainer.val_at_start": False,
        "trainer.lr": 5e-3,
        "checkpoint.every": 1,
        "algorithm.kl_in_reward": True,
        "algorithm.kl_coef": 0.5,
    }
    train(small_run_config(model_dir, reward, **specific | overrides), tmp_path / "run", log=NO_LOG)
    lines = (tmp_path / "run" / "metrics.jsonl").open()
    return [m for m in map(json.loads, lines) if "samples/generated" in m]


def test_score_sits_on_the_last_response_token():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    rewards = token_level_rewards(torch.tensor([2.0, 5.0]), mask)
    assert torch.equal(rewards, torch.tensor([[0.0, 2.0, 0.0], [5.0, 0.0, 0.0]]))


def test_fixed_coefficient_penalises_in_the_reward_not_the_loss(
    tmp_path, micro_model_dir, digit_reward
):
    steps = run(tmp_path, micro_model_dir, digit_reward)
    assert all(m["actor/kl_coef"] == 0.5 for m in steps)
    assert all("actor/kl_loss" not in m for m in steps)  # no loss term in this mode
    assert steps[0]["critic/kl"] == pytest.approx(0.0, abs=1e-6)  # policy == reference
    assert steps[-1]["critic/kl"] > 0.0  # the policy has moved away after two updates


def test_adaptive_coefficient_moves_and_resumes(tmp_path, micro_model_dir, digit_reward):
    steps = run(
        tmp_path,
        micro_model_dir,
        digit_reward,
        **{"algorithm.kl_ctrl": "adaptive", "algorithm.kl_target": 1.0, "algorithm.kl_horizon": 10},
    )
    # KL far below target: beta shrinks by (1 - 0.2 * 6 / 10) per step.
    assert steps[1]["actor/kl_coef"] == pytest.approx(0.5 * 0.88)
    assert steps[2]["actor/kl_coef"] == pytest.approx(0.5 * 0.88**2)
    saved = json.loads((tmp_path / "run" / "checkpoints" / "step_3" / "state.json").read_text())
    assert saved["kl_coef"] == pytest.approx(0.5 * 0.88**3)


def test_kl_in_reward_needs_a_coefficient(micro_model_dir):
    config = build_config({"model.path": str(micro_model_dir), "algorithm.kl_in_reward": True})
    with pytest.raises(ConfigError, match="kl_coef > 0"):
        check_config(config)


def test_discount_reaches_reinforce_plus_plus(tmp_path, micro_model_dir, digit_reward):
    """gamma < 1 changes the returns of a KL-shaped reward, so the run differs from gamma = 1."""
    common = {"algorithm.advantage": "reinforce_plus_plus", "trainer.total_steps": 2}
    plain = run(tmp_path / "a", micro_model_dir, digit_reward, **common)
    discounted = run(
        tmp_path / "b", micro_model_dir, digit_reward, **common | {"algorithm.gamma": 0.5}
    )
    assert plain[0]["critic/score/mean"] == discounted[0]["critic/score/mean"]  # same samples
    assert plain[-1]["actor/pg_loss"] != discounted[-1]["actor/pg_loss"]
