import pytest
import torch

from honing.algorithms.value import clipped_value_loss, explained_variance

MASK = torch.tensor([[1.0, 1.0, 0.0]])


def test_clipped_value_loss_by_hand():
    old = torch.tensor([[0.0, 0.0, 0.0]])
    new = torch.tensor([[0.5, 0.1, 9.0]], requires_grad=True)
    ret = torch.tensor([[1.0, 1.0, 0.0]])
    loss, m = clipped_value_loss(new, old, ret, MASK, clip=0.2)
    # token 1: unclipped (0.5-1)^2 = 0.25, clipped V = 0.2 -> (0.2-1)^2 = 0.64 -> max 0.64
    # token 2: unclipped (0.1-1)^2 = 0.81, clipped V = 0.1 (inside) -> 0.81
    # token_mean of 0.5 * [0.64, 0.81] = 0.3625; the padded token is ignored
    assert loss.item() == pytest.approx(0.3625)
    assert m["critic/vf_clipfrac"].item() == pytest.approx(0.5)
    loss.backward()
    # The clipped branch is active on token 1: no gradient there; token 2: 0.5*2*(0.1-1)/2
    assert torch.allclose(new.grad, torch.tensor([[0.0, -0.45, 0.0]]))


def test_explained_variance():
    ret = torch.tensor([[1.0, 3.0, 100.0]])
    assert explained_variance(ret, ret, MASK).item() == pytest.approx(1.0)
    mean = torch.full_like(ret, 2.0)
    assert explained_variance(mean, ret, MASK).item() == pytest.approx(0.0)
