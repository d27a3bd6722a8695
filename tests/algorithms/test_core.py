"""Masked reductions and logprob / entropy helpers against hand-computed values."""

import math

import pytest
import torch

from honing.algorithms.core import (
    entropy_from_logits,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)

VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])


def test_masked_sum_all_and_per_dim():
    # 1 + 2 + 4 = 7; rows: 1 + 2 = 3, 4; columns: 1 + 4 = 5, 2, 0.
    assert masked_sum(VALUES, MASK) == pytest.approx(7.0)
    torch.testing.assert_close(masked_sum(VALUES, MASK, dim=-1), torch.tensor([3.0, 4.0]))
    torch.testing.assert_close(masked_sum(VALUES, MASK, dim=0), torch.tensor([5.0, 2.0, 0.0]))


def test_masked_sum_ignores_nan_and_inf_in_padding():
    values = torch.tensor([[1.0, float("nan"), float("inf")]], requires_grad=True)
    total = masked_sum(values, torch.tensor([[1, 0, 0]]))
    total.backward()
    assert total.detach() == pytest.approx(1.0)
    torch.testing.assert_close(values.grad, torch.tensor([[1.0, 0.0, 0.0]]))


def test_masked_mean_all_and_per_row():
    # (1 + 2 + 4) / 3 = 2.3333; rows: 3 / 2 = 1.5, 4 / 1 = 4.
    assert masked_mean(VALUES, MASK) == pytest.approx(7.0 / 3.0)
    torch.testing.assert_close(masked_mean(VALUES, MASK, dim=-1), torch.tensor([1.5, 4.0]))


def test_masked_mean_of_empty_mask_is_zero_not_nan():
    assert masked_mean(VALUES, torch.zeros_like(MASK)) == 0.0
    # Row 1 is empty: its mean is 0 while row 0 keeps (1 + 2) / 2 = 1.5.
    rows = masked_mean(VALUES, torch.tensor([[1, 1, 0], [0, 0, 0]]), dim=-1)
    torch.testing.assert_close(rows, torch.tensor([1.5, 0.0]))


def test_masked_mean_accepts_bool_mask():
    assert masked_mean(VALUES, MASK.bool()) == pytest.approx(7.0 / 3.0)


WHITEN_VALUES = torch.tensor([1.0, 2.0, 3.0, 4.0, 100.0])
WHITEN_MASK = torch.tensor([1, 1, 1, 1, 0])


def test_masked_var_unbiased_and_biased():
    # Unmasked 1..4: mean 2.5, squared deviations 2.25 + 0.25 + 0.25 + 2.25 = 5.
    # Unbiased 5 / 3 = 1.6667; biased 5 / 4 = 1.25. The masked 100 must not count.
    assert masked_var(WHITEN_VALUES, WHITEN_MASK) == pytest.approx(5.0 / 3.0)
    assert masked_var(WHITEN_VALUES, WHITEN_MASK, unbiased=False) == pytest.approx(1.25)


def test_masked_var_of_one_or_no_element_is_zero():
    one = masked_var(torch.tensor([3.0, 7.0]), torch.tensor([1, 0]))
    none = masked_var(torch.tensor([3.0, 7.0]), torch.tensor([0, 0]))
    assert one == 0.0 and none == 0.0


def test_masked_whiten():
    # (x - 2.5) / sqrt(5 / 3) with sqrt(5 / 3) = 1.290994: 1.5 / 1.290994 = 1.161895,
    # 0.5 / 1.290994 = 0.387298.
    whitened = masked_whiten(WHITEN_VALUES, WHITEN_MASK)
    expected = torch.tensor([-1.161895, -0.387298, 0.387298, 1.161895])
    torch.testing.assert_close(whitened[:4], expected, atol=1e-5, rtol=0)
    # shift_mean=False adds the mean 2.5 back.
    unshifted = masked_whiten(WHITEN_VALUES, WHITEN_MASK, shift_mean=False)
    torch.testing.assert_close(unshifted[:4], expected + 2.5, atol=1e-5, rtol=0)


def test_logprobs_from_logits_by_hand():
    # logits [0, ln 3] -> probabilities [1/4, 3/4]: ln 0.25 = -1.386294, ln 0.75 = -0.287682.
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, math.log(3.0)]]])  # [1, 2, 2]
    labels = torch.tensor([[0, 1]])
    torch.testing.assert_close(
        logprobs_from_logits(logits, labels), torch.tensor([[-1.386294, -0.287682]])
    )


def test_logprobs_from_logits_matches_log_softmax_gather_with_grad():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 5, requires_grad=True)
    labels = torch.randint(0, 5, (2, 3))
    expected = torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    (expected_grad,) = torch.autograd.grad(expected.sum(), logits)
    got = logprobs_from_logits(logits, labels)
    (got_grad,) = torch.autograd.grad(got.sum(), logits)
    assert got.shape == (2, 3)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(got_grad, expected_grad)


def test_logprobs_from_bf16_logits_are_float32_and_accurate():
    torch.manual_seed(0)
    logits = (torch.randn(2, 4, 64) * 3).to(torch.bfloat16)
    labels = torch.randint(0, 64, (2, 4))
    got = logprobs_from_logits(logits, labels)
    reference = torch.log_softmax(logits.double(), -1).gather(-1, labels.unsqueeze(-1))
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), reference.squeeze(-1), atol=1e-5, rtol=0)


def test_entropy_of_uniform_logits_is_log_vocab():
    # Uniform over 8 tokens: H = ln 8 = 2.079442, whatever the constant logit.
    logits = torch.full((2, 3, 8), 4.0)
    torch.testing.assert_close(entropy_from_logits(logits), torch.full((2, 3), 2.079442))


def test_entropy_by_hand_and_against_categorical():
    # p = [1/4, 3/4]: H = 0.25 * ln 4 + 0.75 * ln(4/3) = 0.346574 + 0.215762 = 0.562335.
    logits = torch.tensor([[[0.0, math.log(3.0)]]])
    torch.testing.assert_close(entropy_from_logits(logits), torch.tensor([[0.562335]]))
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 7) * 5
    expected = torch.distributions.Categorical(logits=logits).entropy()
    torch.testing.assert_close(entropy_from_logits(logits), expected)
