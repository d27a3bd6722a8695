import math

import pytest
import torch

from honing.algorithms.mismatch import mismatch_metrics, truncated_importance_weights

# Two responses; the second has one padded position.
OLD = torch.log(torch.tensor([[0.5, 0.2], [0.9, 0.3]]))
BEHAVIOUR = torch.log(torch.tensor([[0.25, 0.4], [0.9, 0.1]]))
MASK = torch.tensor([[1.0, 1.0], [1.0, 0.0]])


def test_token_level_weights_are_capped_ratios():
    weights = truncated_importance_weights(OLD, BEHAVIOUR, MASK, level="token", cap=1.5)
    # ratios: 0.5/0.25 = 2 -> capped 1.5; 0.2/0.4 = 0.5; 0.9/0.9 = 1; padding -> 0
    assert torch.allclose(weights, torch.tensor([[1.5, 0.5], [1.0, 0.0]]))


def test_sequence_level_weights_multiply_token_ratios():
    weights = truncated_importance_weights(OLD, BEHAVIOUR, MASK, level="sequence", cap=2.0)
    # seq 1: 2 * 0.5 = 1.0 on both tokens; seq 2: 1.0 (the padded 0.3/0.1 is ignored), pad 0
    assert torch.allclose(weights, torch.tensor([[1.0, 1.0], [1.0, 0.0]]))


def test_weights_carry_no_gradient():
    old = OLD.clone().requires_grad_(True)
    assert not truncated_importance_weights(
        old, BEHAVIOUR, MASK, level="token", cap=2
    ).requires_grad


def test_unknown_level():
    with pytest.raises(ValueError, match="choose one of: token, sequence"):
        truncated_importance_weights(OLD, BEHAVIOUR, MASK, level="tok", cap=2.0)


def test_mismatch_metrics_by_hand():
    m = mismatch_metrics(OLD, BEHAVIOUR, MASK)
    # |diffs| on valid tokens: 0.25, 0.2, 0.0 (the padded 0.2 is ignored)
    assert m["rollout_mismatch/prob_diff_mean"].item() == pytest.approx(0.45 / 3)
    assert m["rollout_mismatch/prob_diff_max"].item() == pytest.approx(0.25)
    # |log ratios|: log 2, log 2, 0 (the padded log 3 is ignored)
    assert m["rollout_mismatch/logprob_diff_max"].item() == pytest.approx(math.log(2))
    # k3 = r - log r - 1 with r = old/behaviour: r = 2, 0.5, 1
    k3 = [2 - math.log(2) - 1, 0.5 - math.log(0.5) - 1, 0.0]
    assert m["rollout_mismatch/kl"].item() == pytest.approx(sum(k3) / 3, rel=1e-5)
