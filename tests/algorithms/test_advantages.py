"""The advantage estimators and their registry against hand-computed values."""

import inspect
from dataclasses import fields

import pytest
import torch

from honing.algorithms.advantage_registry import (
    ADVANTAGE_ESTIMATORS,
    INPUTS,
    SETTINGS,
    AdvantageSettings,
    get_advantage,
    register_advantage,
)
from honing.algorithms.advantages import (
    distill,
    dr_grpo,
    gae,
    grpo,
    reinforce_plus_plus,
    reinforce_plus_plus_baseline,
    remax,
    rloo,
)
from honing.config import AlgorithmConfig

# Group 0 = scores [1, 0, 0, 1]: mean 0.5, squared deviations 4 * 0.25 = 1,
# unbiased std sqrt(1 / 3) = 0.577350, advantages +-0.5 / 0.577350 = +-0.866025.
# Group 1 = scores [1, 1]: all equal, std 0, advantages 0.
SCORES = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
GROUP_IDS = torch.tensor([0, 0, 0, 0, 1, 1])
EXPECTED = torch.tensor([0.866025, -0.866025, -0.866025, 0.866025, 0.0, 0.0])


def test_grpo_by_hand():
    advantages, returns = grpo(SCORES, torch.ones(6, 3), GROUP_IDS)
    assert advantages.shape == (6, 3)
    torch.testing.assert_close(advantages, EXPECTED[:, None].expand(6, 3), atol=1e-5, rtol=0)
    torch.testing.assert_close(returns, advantages)


def test_grpo_zeroes_padding():
    # Response lengths 3, 1, 2, 3, 0, 2: the advantage fills the response, 0 after it.
    lengths = torch.tensor([3, 1, 2, 3, 0, 2])
    response_mask = (torch.arange(3)[None, :] < lengths[:, None]).long()  # [6, 3]
    advantages, returns = grpo(SCORES, response_mask, GROUP_IDS)
    torch.testing.assert_close(advantages, EXPECTED[:, None] * response_mask, atol=1e-5, rtol=0)
    torch.testing.assert_close(returns, advantages)


def test_grpo_without_std_normalisation():
    # Group 0: 1 - 0.5 = 0.5, 0 - 0.5 = -0.5; group 1: 0.
    advantages, _ = grpo(SCORES, torch.ones(6, 1), GROUP_IDS, norm_adv_by_std=False)
    expected = torch.tensor([0.5, -0.5, -0.5, 0.5, 0.0, 0.0])
    torch.testing.assert_close(advantages.squeeze(-1), expected)


def test_grpo_interleaved_and_non_contiguous_group_ids():
    # Group 7 = [2, 4]: mean 3 -> -1, +1. Group 3 = [5, 6]: mean 5.5 -> -0.5, +0.5.
    scores = torch.tensor([2.0, 5.0, 4.0, 6.0])
    group_ids = torch.tensor([7, 3, 7, 3])
    advantages, _ = grpo(scores, torch.ones(4, 1), group_ids, norm_adv_by_std=False)
    torch.testing.assert_close(advantages.squeeze(-1), torch.tensor([-1.0, -0.5, 1.0, 0.5]))


def test_grpo_singleton_group_gets_zero_advantage():
    # Group 9 = [3] alone -> 0. Group 2 = [1, 2]: mean 1.5, deviations +-0.5,
    # unbiased var (0.25 + 0.25) / 1 = 0.5, std 0.707107 -> +-0.5 / 0.707107 = +-0.707106.
    scores = torch.tensor([3.0, 1.0, 2.0])
    advantages, _ = grpo(scores, torch.ones(3, 1), torch.tensor([9, 2, 2]))
    expected = torch.tensor([0.0, -0.707106, 0.707106])
    torch.testing.assert_close(advantages.squeeze(-1), expected, atol=1e-5, rtol=0)
    # Without epsilon the singleton would be 0 / 0 = nan unless its std is taken as 1.
    advantages, _ = grpo(scores, torch.ones(3, 1), torch.tensor([9, 2, 2]), epsilon=0.0)
    torch.testing.assert_close(advantages.squeeze(-1), torch.tensor([0.0, -0.707107, 0.707107]))


def test_grpo_matches_per_group_torch_std_reference():
    torch.manual_seed(0)
    group_ids = torch.arange(5).repeat_interleave(4)[torch.randperm(20)]
    scores = torch.randn(20)
    advantages, _ = grpo(scores, torch.ones(20, 1), group_ids, epsilon=1e-6)
    expected = torch.empty(20)
    for group in range(5):
        members = group_ids == group
        group_scores = scores[members]
        expected[members] = (group_scores - group_scores.mean()) / (group_scores.std() + 1e-6)
    torch.testing.assert_close(advantages.squeeze(-1), expected)


def test_grpo_accepts_integer_scores():
    # Pass / fail rewards as ints: [1, 0] -> mean 0.5, std 0.707107 -> +-0.707106.
    advantages, _ = grpo(torch.tensor([1, 0]), torch.ones(2, 1), torch.tensor([0, 0]))
    assert advantages.dtype == torch.float32
    torch.testing.assert_close(
        advantages.squeeze(-1), torch.tensor([0.707106, -0.707106]), atol=1e-5, rtol=0
    )


def test_grpo_rejects_mismatched_batch():
    with pytest.raises(ValueError, match="number of samples"):
        grpo(torch.zeros(3), torch.ones(4, 2), torch.zeros(3, dtype=torch.long))


def test_registry_lookup():
    assert get_advantage("grpo").fn is grpo
    assert ADVANTAGE_ESTIMATORS["grpo"].fn is grpo


def test_unknown_estimator_names_the_choices():
    with pytest.raises(
        ValueError, match=r"unknown advantage estimator 'vtrace'; choose one of: .*grpo"
    ):
        get_advantage("vtrace")


def test_register_new_estimator_and_reject_duplicates():
    @register_advantage("test_zero")
    def zero(scores, response_mask, group_ids):
        return response_mask * 0.0, response_mask * 0.0

    try:
        assert get_advantage("test_zero").fn is zero
        with pytest.raises(ValueError, match="already registered"):
            register_advantage("grpo")(zero)
    finally:
        del ADVANTAGE_ESTIMATORS["test_zero"]
    assert "test_zero" not in ADVANTAGE_ESTIMATORS


# --- Dr. GRPO, RLOO ---------------------------------------------------------------------------

# Lengths 3, 1, 2, 3, 0, 2 for the six SCORES / GROUP_IDS samples above.
PADDED_MASK = (torch.arange(3)[None, :] < torch.tensor([3, 1, 2, 3, 0, 2])[:, None]).long()


def test_dr_grpo_centres_without_std():
    # Group 0 = [1, 0, 0, 1], mean 0.5 -> +-0.5; group 1 = [1, 1] all equal -> 0.
    advantages, returns = dr_grpo(SCORES, PADDED_MASK, GROUP_IDS)
    expected = torch.tensor([0.5, -0.5, -0.5, 0.5, 0.0, 0.0])
    torch.testing.assert_close(advantages, expected[:, None] * PADDED_MASK)
    torch.testing.assert_close(returns, advantages)
    # A group of one: 3 - 3 = 0; group 2 = [1, 2], mean 1.5 -> -0.5, +0.5.
    advantages, _ = dr_grpo(
        torch.tensor([3.0, 1.0, 2.0]), torch.ones(3, 1), torch.tensor([9, 2, 2])
    )
    torch.testing.assert_close(advantages.squeeze(-1), torch.tensor([0.0, -0.5, 0.5]))


def test_rloo_leave_one_out_baseline():
    # Group 0 = [1, 0, 0, 1], sum 2: 1 - (2 - 1) / 3 = 0.666667, 0 - 2 / 3 = -0.666667.
    # Group 1 = [1, 1]: 1 - 1 = 0.
    advantages, returns = rloo(SCORES, PADDED_MASK, GROUP_IDS)
    expected = torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.0, 0.0])
    torch.testing.assert_close(advantages, expected[:, None] * PADDED_MASK)
    torch.testing.assert_close(returns, advantages)


def test_rloo_three_samples_and_a_singleton():
    # Group 0 = [2, 4, 9]: 2 - (4 + 9) / 2 = -4.5, 4 - (2 + 9) / 2 = -1.5, 9 - (2 + 4) / 2 = 6
    # (= 3 / 2 * (r - 5)). Group 5 = [7] alone: no other sample, 0 (not 7 - 0 / 0).
    scores = torch.tensor([2.0, 4.0, 7.0, 9.0])
    advantages, _ = rloo(scores, torch.ones(4, 1), torch.tensor([0, 0, 5, 0]))
    torch.testing.assert_close(advantages.squeeze(-1), torch.tensor([-4.5, -1.5, 0.0, 6.0]))


# --- REINFORCE++ ------------------------------------------------------------------------------


def test_reinforce_plus_plus_baseline_by_hand():
    # Centred: group 0 = [1, 0] -> 0.5, -0.5; group 1 = [3, 1] -> 1, -1. Over the six tokens
    # (lengths 2, 1, 1, 2) [0.5, 0.5, -0.5, 1, -1, -1]: mean -1 / 12, squared deviations
    # 2 * 0.340278 + 0.173611 + 1.173611 + 2 * 0.840278 = 3.708333, unbiased var / 5 = 0.741667,
    # std 0.861201: 0.583333 / 0.861201 = 0.677349, -0.416667 / std = -0.483821,
    # 1.083333 / std = 1.257934, -0.916667 / std = -1.064406.
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 0, 0], [1, 1, 0]])
    advantages, returns = reinforce_plus_plus_baseline(
        torch.tensor([1.0, 0.0, 3.0, 1.0]), mask, torch.tensor([0, 0, 1, 1])
    )
    expected = torch.tensor([0.677349, -0.483821, 1.257934, -1.064406])[:, None] * mask
    torch.testing.assert_close(advantages, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(returns, advantages)


def test_reinforce_plus_plus_discounts_then_whitens():
    # gamma 0.5, score 1 on the last token of row 0: returns 0.25, 0.5, 1; row 1 (score 0) 0, 0.
    # Five tokens: mean 0.35, squared deviations 0.01 + 0.0225 + 0.4225 + 2 * 0.1225 = 0.7,
    # unbiased var 0.175, std 0.418330: -0.1 / std = -0.239046, 0.15 / std = 0.358569,
    # 0.65 / std = 1.553797, -0.35 / std = -0.836660.
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    advantages, returns = reinforce_plus_plus(
        torch.tensor([1.0, 0.0]), mask, torch.tensor([0, 1]), gamma=0.5
    )
    torch.testing.assert_close(returns, torch.tensor([[0.25, 0.5, 1.0], [0.0, 0.0, 0.0]]))
    expected = torch.tensor([[-0.239046, 0.358569, 1.553797], [-0.836660, -0.836660, 0.0]])
    torch.testing.assert_close(advantages, expected, atol=1e-5, rtol=0)


def test_reinforce_plus_plus_token_rewards_skip_masked_positions():
    # Row 0, KL penalty folded in: -0.1, -0.1, 1 - 0.1 -> returns 0.7, 0.8, 0.9 (gamma 1).
    # Row 1 has a masked hole at t = 1: its reward 7 is ignored and the return carries over it
    # undiscounted: t = 2 gives 2, t = 0 gives 1 + 0.5 * 2 = 2 with gamma 0.5.
    # Row 2 is padding after t = 0: the 100 there must not reach t = 0.
    token_rewards = torch.tensor([[-0.1, -0.1, 0.9], [1.0, 7.0, 2.0], [0.5, 100.0, 100.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 1], [1, 0, 0]])
    _, returns = reinforce_plus_plus(
        torch.zeros(3), mask, torch.arange(3), token_rewards=token_rewards, gamma=1.0
    )
    torch.testing.assert_close(returns[0], torch.tensor([0.7, 0.8, 0.9]))
    _, returns = reinforce_plus_plus(
        torch.zeros(3), mask, torch.arange(3), token_rewards=token_rewards, gamma=0.5
    )
    torch.testing.assert_close(returns[1:], torch.tensor([[2.0, 0.0, 2.0], [0.5, 0.0, 0.0]]))


def test_reinforce_plus_plus_default_rewards_sit_on_the_last_valid_token():
    # gamma 1: every valid token's return is its row's score; an empty row gets nothing.
    mask = torch.tensor([[1, 0, 1], [1, 1, 0], [0, 0, 0], [1, 0, 0]])
    _, returns = reinforce_plus_plus(torch.tensor([3.0, 5.0, 8.0, 2.0]), mask, torch.arange(4))
    torch.testing.assert_close(
        returns, torch.tensor([[3.0, 0, 3], [5, 5, 0], [0, 0, 0], [2, 0, 0]])
    )


def test_reinforce_plus_plus_all_equal_rewards_give_zero_not_nan():
    # Every return is 1: deviation 0, variance 0, 0 * rsqrt(0 + eps) = 0.
    mask = torch.tensor([[1, 1], [1, 0]])
    for estimator in (reinforce_plus_plus, reinforce_plus_plus_baseline):
        advantages, _ = estimator(torch.ones(2), mask, torch.tensor([0, 0]))
        torch.testing.assert_close(advantages, torch.zeros(2, 2))


# --- ReMax ------------------------------------------------------------------------------------


def test_remax_subtracts_the_greedy_score():
    # 1 - 0.5 = 0.5, 0 - 0.5 = -0.5, 1 - 1 = 0 on every response token; returns are the scores.
    mask = torch.tensor([[1, 1], [1, 0], [1, 1]])
    advantages, returns = remax(
        torch.tensor([1.0, 0.0, 1.0]),
        mask,
        torch.tensor([0, 0, 1]),
        baseline_scores=torch.tensor([0.5, 0.5, 1.0]),
    )
    torch.testing.assert_close(advantages, torch.tensor([[0.5, 0.5], [-0.5, 0.0], [0.0, 0.0]]))
    torch.testing.assert_close(returns, torch.tensor([[1.0, 1.0], [0.0, 0.0], [1.0, 1.0]]))


def test_remax_gives_each_token_its_reward_to_go():
    # A KL penalty in the token rewards, baseline 0.5, 0.5, 0: A_t = sum_{k >= t} r_k - b.
    # Row 0: -0.1, -0.2, 1 - 0.3 = 0.7 -> returns 0.4, 0.5, 0.7 -> A = -0.1, 0, 0.2.
    # Row 1: -0.3, 1 - 0.1 = 0.9, then padding holding 99 -> returns 0.6, 0.9 -> A = 0.1, 0.4.
    # Row 2 has a masked hole at t = 1 whose 7 is ignored: -0.2, _, -0.4 -> returns -0.6, -0.4.
    # The whole response's sum on every token would give row 0 -0.1 everywhere instead.
    token_rewards = torch.tensor([[-0.1, -0.2, 0.7], [-0.3, 0.9, 99.0], [-0.2, 7.0, -0.4]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 1]])
    advantages, returns = remax(
        torch.zeros(3),
        mask,
        torch.arange(3),
        token_rewards=token_rewards,
        baseline_scores=torch.tensor([0.5, 0.5, 0.0]),
    )
    torch.testing.assert_close(
        returns, torch.tensor([[0.4, 0.5, 0.7], [0.6, 0.9, 0.0], [-0.6, 0.0, -0.4]])
    )
    torch.testing.assert_close(
        advantages, torch.tensor([[-0.1, 0.0, 0.2], [0.1, 0.4, 0.0], [-0.6, 0.0, -0.4]])
    )


def test_remax_needs_baseline_scores_of_shape_n():
    with pytest.raises(ValueError, match="'remax' needs baseline_scores="):
        remax(torch.zeros(2), torch.ones(2, 1), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"baseline_scores must have shape \(2,\)"):
        remax(torch.zeros(2), torch.ones(2, 1), torch.zeros(2), baseline_scores=torch.zeros(3))


# --- GAE --------------------------------------------------------------------------------------


def test_gae_monte_carlo_limit_by_hand():
    # gamma = lam = 1, score 1 on t = 2, V = 0.5, 0.6, 0.7. TD errors: t2: 1 - 0.7 = 0.3,
    # t1: 0.7 - 0.6 = 0.1, t0: 0.6 - 0.5 = 0.1 -> A = 0.5, 0.4, 0.3; returns A + V = 1, 1, 1.
    # Whitened: mean 0.4, unbiased var (0.01 + 0 + 0.01) / 2 = 0.01 -> 1, 0, -1.
    values = torch.tensor([[0.5, 0.6, 0.7]])
    advantages, returns = gae(torch.tensor([1.0]), torch.ones(1, 3), torch.zeros(1), values=values)
    torch.testing.assert_close(returns, torch.ones(1, 3))
    torch.testing.assert_close(advantages, torch.tensor([[1.0, 0.0, -1.0]]), atol=1e-5, rtol=0)


def test_gae_discounted_with_padding_by_hand():
    # gamma 0.9, lam 0.5 (gamma * lam = 0.45).
    # Row 0, score 1, V = 0.5, 0.6, 0.7: t2: 1 - 0.7 = 0.3; t1: 0.9 * 0.7 - 0.6 = 0.03,
    #   A = 0.03 + 0.45 * 0.3 = 0.165; t0: 0.9 * 0.6 - 0.5 = 0.04, A = 0.04 + 0.45 * 0.165
    #   = 0.11425. Returns 0.61425, 0.765, 1.
    # Row 1, score 2 on t1, padding at t2 holds V = 99 that must not be used: t1: 2 - 0.4 = 1.6;
    #   t0: 0.9 * 0.4 - 0.2 = 0.16, A = 0.16 + 0.45 * 1.6 = 0.88. Returns 1.08, 2.
    values = torch.tensor([[0.5, 0.6, 0.7], [0.2, 0.4, 99.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    advantages, returns = gae(
        torch.tensor([1.0, 2.0]), mask, torch.arange(2), values=values, gamma=0.9, lam=0.5
    )
    torch.testing.assert_close(returns, torch.tensor([[0.61425, 0.765, 1.0], [1.08, 2.0, 0.0]]))
    raw = torch.tensor([0.11425, 0.165, 0.3, 0.88, 1.6])  # the five response tokens
    expected = (raw - raw.mean()) / raw.std()
    torch.testing.assert_close(advantages[mask.bool()], expected, atol=1e-5, rtol=0)
    assert advantages[1, 2] == 0.0


def test_gae_skips_a_masked_hole():
    # Mask 1, 0, 1 with V = 0.5, 99, 0.7, score 1, gamma 0.9, lam 0.5: t2: A = 0.3; t1 is
    # skipped (its 99 unused); t0 sees the next valid token: 0.9 * 0.7 - 0.5 = 0.13,
    # A = 0.13 + 0.45 * 0.3 = 0.265. Returns 0.765, 0, 1. Whitened two tokens: -+0.707107.
    advantages, returns = gae(
        torch.tensor([1.0]),
        torch.tensor([[1, 0, 1]]),
        torch.zeros(1),
        values=torch.tensor([[0.5, 99.0, 0.7]]),
        gamma=0.9,
        lam=0.5,
    )
    torch.testing.assert_close(returns, torch.tensor([[0.765, 0.0, 1.0]]))
    torch.testing.assert_close(advantages, torch.tensor([[-0.707107, 0.0, 0.707107]]))


def test_gae_single_token_responses_and_an_empty_one():
    # T = 1: A = r - V = 1 - 0.25 = 0.75 and 0 - 0.5 = -0.5; returns 1, 0. Whitened: mean
    # 0.125, deviations +-0.625, unbiased var 0.78125 -> +-0.707107. The empty row gets 0.
    advantages, returns = gae(
        torch.tensor([1.0, 0.0, 4.0]),
        torch.tensor([[1], [1], [0]]),
        torch.zeros(3),
        values=torch.tensor([[0.25], [0.5], [3.0]]),
    )
    torch.testing.assert_close(returns, torch.tensor([[1.0], [0.0], [0.0]]))
    torch.testing.assert_close(advantages, torch.tensor([[0.707107], [-0.707107], [0.0]]))


def test_gae_token_rewards_and_missing_values():
    # KL penalty -0.1 per token plus score 1 on the last, V = 0: A = returns = 0.7, 0.8, 0.9.
    token_rewards = torch.tensor([[-0.1, -0.1, 0.9]])
    _, returns = gae(
        torch.zeros(1),
        torch.ones(1, 3),
        torch.zeros(1),
        values=torch.zeros(1, 3),
        token_rewards=token_rewards,
    )
    torch.testing.assert_close(returns, torch.tensor([[0.7, 0.8, 0.9]]))
    with pytest.raises(ValueError, match="'gae' needs values="):
        gae(torch.zeros(1), torch.ones(1, 3), torch.zeros(1))
    with pytest.raises(ValueError, match=r"values must have shape \(1, 3\)"):
        gae(torch.zeros(1), torch.ones(1, 3), torch.zeros(1), values=torch.zeros(1, 2))


# --- every estimator --------------------------------------------------------------------------

REQUIRED_OPTIONS = {
    "remax": lambda n, t: {"baseline_scores": torch.rand(n)},
    "gae": lambda n, t: {"values": torch.rand(n, t, requires_grad=True)},
    "distill": lambda n, t: {"distill_rewards": torch.rand(n, t, requires_grad=True)},
}


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
def test_every_estimator_is_finite_zero_on_padding_and_detached(name):
    torch.manual_seed(0)
    scores = torch.randint(0, 2, (6,)).float()
    group_ids = torch.tensor([0, 0, 0, 1, 1, 2])  # group 2 is a singleton
    options = REQUIRED_OPTIONS.get(name, lambda n, t: {})(6, 3)
    advantages, returns = get_advantage(name)(scores, PADDED_MASK, group_ids, **options)
    for result in (advantages, returns):
        assert result.shape == (6, 3) and torch.isfinite(result).all()
        assert not result.requires_grad
        assert (result[PADDED_MASK == 0] == 0).all()


# --- settings and inputs --------------------------------------------------------------------

# each away from its default
CHANGED = {"gamma": 0.5, "lam": 0.5, "norm_adv_by_std": False, "distill_score_coef": 0.5}


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
def test_declared_settings_and_inputs_are_the_functions_keyword_arguments(name):
    estimator = ADVANTAGE_ESTIMATORS[name]
    keywords = {
        p.name
        for p in inspect.signature(estimator.fn).parameters.values()
        if p.kind is p.KEYWORD_ONLY
    }
    assert set(estimator.settings) == keywords & set(SETTINGS)
    assert set(estimator.inputs) == keywords & set(INPUTS)


@pytest.mark.parametrize(
    ("name", "key"),
    [(name, key) for name in sorted(ADVANTAGE_ESTIMATORS) for key in SETTINGS],
)
def test_a_setting_reaches_the_estimator_that_reads_it_and_is_refused_elsewhere(name, key):
    torch.manual_seed(0)
    options = REQUIRED_OPTIONS.get(name, lambda n, t: {})(6, 3)
    options["token_rewards"] = torch.rand(6, 3)
    estimator = get_advantage(name)
    settings = AdvantageSettings(**{key: CHANGED[key]})
    if key not in estimator.settings:
        with pytest.raises(ValueError, match=f"{name!r} does not use {key}"):
            estimator(SCORES, PADDED_MASK, GROUP_IDS, settings, **options)
        return
    changed, _ = estimator(SCORES, PADDED_MASK, GROUP_IDS, settings, **options)
    default, _ = estimator(SCORES, PADDED_MASK, GROUP_IDS, **options)
    assert not torch.allclose(changed, default)


def test_settings_default_to_the_configs():
    config = AlgorithmConfig()
    assert {f.name: f.default for f in fields(AdvantageSettings)} == {
        key: getattr(config, key) for key in SETTINGS
    }


def test_an_estimator_takes_only_the_inputs_it_declares():
    # grpo is offered token rewards and ignores them (its scores are their sums).
    advantages, _ = get_advantage("grpo")(
        SCORES, PADDED_MASK, GROUP_IDS, token_rewards=torch.full((6, 3), 9.0)
    )
    torch.testing.assert_close(advantages, grpo(SCORES, PADDED_MASK, GROUP_IDS)[0])


def test_registration_refuses_a_setting_or_input_there_is_not():
    with pytest.raises(ValueError, match="unknown setting epsilon; the settings are gamma"):
        register_advantage("test_bad", settings=("epsilon",))(grpo)
    with pytest.raises(ValueError, match="unknown input rewards; the inputs are token_rewards"):
        register_advantage("test_bad", inputs=("rewards",))(grpo)
    # a declaration and the function's arguments that disagree, either way
    with pytest.raises(ValueError, match="lam, norm_adv_by_std is declared but not an argument"):
        register_advantage("test_bad", settings=("lam",))(grpo)
    assert "test_bad" not in ADVANTAGE_ESTIMATORS


# --- on-policy distillation -------------------------------------------------------------------


def test_distill_gives_each_token_its_own_reward_plus_the_scores_weighted_grpo_advantage():
    """By hand: rewards r (log pi_T - log pi_S, scaled) on the response tokens; the group of
    scores [1, 0] has mean 0.5 and unbiased std sqrt(0.5), so GRPO gives +-0.5 / 0.70711 =
    +-0.70711 (epsilon 1e-6 aside), weighted 0.5: +-0.35355 on every token of each row."""
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    rewards = torch.tensor([[0.1, -0.2, 9.0], [0.3, 9.0, 9.0]])  # 9: padding, never counted
    alone, returns = distill(
        torch.tensor([1.0, 0.0]), mask, torch.tensor([0, 0]), distill_rewards=rewards
    )
    torch.testing.assert_close(alone, torch.tensor([[0.1, -0.2, 0.0], [0.3, 0.0, 0.0]]))
    torch.testing.assert_close(returns, alone)
    mixed, _ = distill(
        torch.tensor([1.0, 0.0]),
        mask,
        torch.tensor([0, 0]),
        distill_rewards=rewards,
        distill_score_coef=0.5,
    )
    expected = torch.tensor([[0.1 + 0.35355, -0.2 + 0.35355, 0.0], [0.3 - 0.35355, 0.0, 0.0]])
    torch.testing.assert_close(mixed, expected, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="'distill' needs distill_rewards="):
        distill(torch.zeros(1), torch.ones(1, 3), torch.zeros(1))
