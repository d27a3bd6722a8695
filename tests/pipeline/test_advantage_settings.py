"""What the loop hands the advantage estimators: settings a chosen estimator cannot use are
refused with the config, and ReMax gets the KL penalty of the reward token by token."""

import dataclasses

import pytest
import torch

from honing import cli
from honing.algorithms import kl_penalty
from honing.config import build_config
from honing.errors import ConfigError
from honing.pipeline.collect import collect
from honing.pipeline.experience import make_experience, token_level_rewards
from honing.pipeline.rules import check_config

from .fakes import TinyLM, fake_components

NO_LOG = lambda message: None  # noqa: E731


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"algorithm.gamma": 0.5},
            "algorithm.gamma=0.5 has no effect with algorithm.advantage=grpo; it applies to "
            "gae, reinforce_plus_plus. Remove it or choose one of those",
        ),
        (
            {"algorithm.advantage": "dr_grpo", "algorithm.norm_adv_by_std": False},
            "algorithm.norm_adv_by_std=false has no effect with algorithm.advantage=dr_grpo; "
            "it applies to grpo.",
        ),
        (
            {"algorithm.advantage": "reinforce_plus_plus", "algorithm.lam": 0.95},
            "algorithm.lam=0.95 has no effect with algorithm.advantage=reinforce_plus_plus; "
            "it applies to gae.",
        ),
        (
            {"algorithm.advantage": "remax", "algorithm.gamma": 0.99},
            "algorithm.gamma=0.99 has no effect with algorithm.advantage=remax",
        ),
    ],
)
def test_a_setting_the_estimator_does_not_read_is_refused(overrides, message):
    config = build_config({"model.path": "builtin:tiny"} | overrides)
    with pytest.raises(ConfigError) as refused:
        check_config(config)
    assert str(refused.value).startswith(message)


@pytest.mark.parametrize(
    "overrides",
    [
        {"algorithm.advantage": "gae", "algorithm.gamma": 0.99, "algorithm.lam": 0.95},
        {"algorithm.advantage": "reinforce_plus_plus", "algorithm.gamma": 0.5},
        {"algorithm.advantage": "grpo", "algorithm.norm_adv_by_std": False},
        {"algorithm.advantage": "rloo", "algorithm.gamma": 1.0},  # set to its default
    ],
)
def test_a_setting_the_estimator_reads_is_accepted(overrides):
    check_config(build_config({"model.path": "builtin:tiny"} | overrides))


def test_honing_train_refuses_it_in_one_line_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["train", "model.path=builtin:tiny", "algorithm.lam=0.9", "--output-dir", str(out)]
    assert cli.main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "honing: error: algorithm.lam=0.9 has no effect with algorithm.advantage=grpo; it "
        "applies to gae. Remove it or choose one of those"
    ]
    assert not out.exists()


def test_remax_with_the_kl_in_the_reward_gives_each_token_its_reward_to_go(digit_reward):
    beta = 0.5
    config = build_config(
        {
            "model.path": "unused",
            "reward.function": digit_reward,
            "rollout.batch_size": 2,
            "rollout.group_size": 3,
            "rollout.max_new_tokens": 4,
            "algorithm.advantage": "remax",
            "algorithm.kl_in_reward": True,
            "algorithm.kl_coef": beta,
            "algorithm.kl_estimator": "k1",
        }
    )
    check_config(config)
    parts = fake_components(config, log=NO_LOG)
    # A reference unlike the policy, so every token has a KL of its own.
    parts = dataclasses.replace(parts, reference=TinyLM(len(parts.tokenizer), seed=1))
    got = collect(config, parts, step=1, seed=5)
    rollouts, rewards = [r for r, _ in got.kept], [s.reward for _, s in got.kept]
    exp = make_experience(config, parts, rollouts, rewards, got.baselines)

    mask = exp.batch.response_mask  # [N, R]
    kl = kl_penalty(exp.old_logprobs, exp.ref_logprobs, "k1") * mask  # [N, R]
    token_rewards = token_level_rewards(torch.tensor(rewards), mask) - beta * kl  # [N, R]
    baseline = torch.tensor([got.baselines[r.group_index] for r in rollouts])  # [N]
    expected = torch.zeros_like(token_rewards)
    for t in range(mask.shape[1]):  # A_t = sum_{k >= t} r_k - b on response tokens
        expected[:, t] = (token_rewards[:, t:].sum(-1) - baseline) * mask[:, t]
    assert (mask.sum(-1) > 1).any() and (kl[mask.bool()] != 0).all()
    torch.testing.assert_close(exp.advantages, expected)
