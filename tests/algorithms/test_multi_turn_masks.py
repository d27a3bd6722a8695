"""Multi-turn responses: tool responses sit inside a response as holes of its mask (the model
read them, it did not sample them). Every estimator, policy loss, aggregation and the KL term
must then count exactly the tokens the model sampled: the same as the response with the
holes taken out."""

import pytest
import torch

from honing.algorithms import POLICY_LOSSES, get_policy_loss, kl_penalty
from honing.algorithms.advantage_registry import ADVANTAGE_ESTIMATORS, get_advantage
from honing.algorithms.losses import LOSS_AGGREGATIONS, aggregate_loss

# 1 = sampled by the model, 0 inside a tool response, then padding: rows of 8 columns
MASK = torch.tensor(
    [
        [1, 1, 0, 0, 0, 1, 1, 0],
        [1, 0, 0, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 1, 1, 1],
        [1, 1, 0, 1, 0, 0, 0, 0],
    ]
)
SCORES = torch.tensor([1.0, 0.0, 1.0, 0.0])
GROUPS = torch.tensor([0, 0, 1, 1])
OPTIONS = {
    "remax": {"baseline_scores": torch.tensor([0.5, 0.5, 0.5, 0.5])},
    "gae": {"values": torch.zeros(4, 8)},
    "distill": {"distill_rewards": torch.arange(32.0).view(4, 8) / 32},
}


def compact(x: torch.Tensor, mask: torch.Tensor = MASK) -> torch.Tensor:
    """Each row's sampled tokens moved to its front (the holes taken out), zeros after."""
    out = torch.zeros_like(x)
    for row in range(x.shape[0]):
        kept = x[row][mask[row].bool()]
        out[row, : len(kept)] = kept
    return out


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
def test_every_estimator_sees_the_response_without_its_tool_responses(name):
    """An estimator's advantages over a response with holes are its advantages over the
    response with the holes taken out, put back at the sampled tokens; 0 in the holes."""
    options = OPTIONS.get(name, {})
    holes, _ = get_advantage(name)(SCORES, MASK, GROUPS, **options)
    per_token = ("values", "distill_rewards")  # taken out of the holes like the mask
    shut = {k: compact(v) if k in per_token else v for k, v in options.items()}
    solid, _ = get_advantage(name)(SCORES, compact(MASK), GROUPS, **shut)
    assert (holes[MASK == 0] == 0).all()
    torch.testing.assert_close(compact(holes), solid)


@pytest.mark.parametrize("mode", sorted(LOSS_AGGREGATIONS))
@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_every_policy_loss_and_aggregation_counts_the_sampled_tokens_only(name, mode):
    torch.manual_seed(0)
    old = -torch.rand(4, 8)
    new = old + 0.3 * torch.randn(4, 8)
    advantages = torch.randn(4)[:, None].expand(4, 8) * MASK
    options = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "loss_agg": mode}
    counts = {"loss_scale_len": 8}
    loss = get_policy_loss(name)
    with_holes, _ = loss(new, old, advantages, MASK, **options, **counts)
    without, _ = loss(
        compact(new), compact(old), compact(advantages), compact(MASK), **options, **counts
    )
    torch.testing.assert_close(with_holes, without)


@pytest.mark.parametrize("mode", sorted(LOSS_AGGREGATIONS))
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_the_kl_term_counts_the_sampled_tokens_only(estimator, mode):
    torch.manual_seed(1)
    policy, reference = -torch.rand(4, 8), -torch.rand(4, 8)
    kl = kl_penalty(policy, reference, estimator)
    with_holes = aggregate_loss(kl, MASK, mode, loss_scale_len=8)
    without = aggregate_loss(compact(kl), compact(MASK), mode, loss_scale_len=8)
    torch.testing.assert_close(with_holes, without)


def test_the_score_goes_on_the_last_token_the_model_sampled():
    """Rewards per token (the KL-in-reward estimators' input): the score sits on the last
    sampled token of each row, after its tool responses, not at its count of tokens."""
    from honing.pipeline.experience import token_level_rewards

    rewards = token_level_rewards(SCORES, MASK.float())
    last = [6, 5, 7, 3]
    expected = torch.zeros(4, 8)
    expected[torch.arange(4), last] = SCORES
    torch.testing.assert_close(rewards, expected)
