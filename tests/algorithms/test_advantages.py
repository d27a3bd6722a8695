"""GRPO advantages and the estimator registry against hand-computed values."""

import pytest
import torch

from honing.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    get_advantage,
    grpo,
    register_advantage,
)

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
    advantages, _ = grpo(SCORES, torch.ones(6, 1), GROUP_IDS, norm_by_std=False)
    expected = torch.tensor([0.5, -0.5, -0.5, 0.5, 0.0, 0.0])
    torch.testing.assert_close(advantages.squeeze(-1), expected)


def test_grpo_interleaved_and_non_contiguous_group_ids():
    # Group 7 = [2, 4]: mean 3 -> -1, +1. Group 3 = [5, 6]: mean 5.5 -> -0.5, +0.5.
    scores = torch.tensor([2.0, 5.0, 4.0, 6.0])
    group_ids = torch.tensor([7, 3, 7, 3])
    advantages, _ = grpo(scores, torch.ones(4, 1), group_ids, norm_by_std=False)
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
    assert get_advantage("grpo") is grpo
    assert ADVANTAGE_ESTIMATORS["grpo"] is grpo


def test_unknown_estimator_names_the_choices():
    with pytest.raises(
        ValueError, match=r"unknown advantage estimator 'gae'; choose one of: .*grpo"
    ):
        get_advantage("gae")


def test_register_new_estimator_and_reject_duplicates():
    @register_advantage("test_zero")
    def zero(scores, response_mask, group_ids):
        return response_mask * 0.0, response_mask * 0.0

    try:
        assert get_advantage("test_zero") is zero
        with pytest.raises(ValueError, match="already registered"):
            register_advantage("grpo")(zero)
    finally:
        del ADVANTAGE_ESTIMATORS["test_zero"]
    assert "test_zero" not in ADVANTAGE_ESTIMATORS
