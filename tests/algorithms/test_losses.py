"""KL estimators and loss aggregation against hand-computed values."""

import pytest
import torch

from honing.algorithms.losses import aggregate_loss, kl_penalty

# --- KL estimators ---------------------------------------------------------------------------

LOGPROBS = torch.tensor([[-1.0, -2.0]])
REF_LOGPROBS = torch.tensor([[-1.5, -1.0]])


def test_kl_k1():
    # logprob - ref: -1 - (-1.5) = 0.5, -2 - (-1) = -1.
    torch.testing.assert_close(
        kl_penalty(LOGPROBS, REF_LOGPROBS, "k1"), torch.tensor([[0.5, -1.0]])
    )


def test_kl_k2():
    # 0.5 * 0.5^2 = 0.125, 0.5 * (-1)^2 = 0.5.
    torch.testing.assert_close(
        kl_penalty(LOGPROBS, REF_LOGPROBS, "k2"), torch.tensor([[0.125, 0.5]])
    )


def test_kl_k3_is_the_default():
    # d = ref - logprob = -0.5, 1: exp(-0.5) + 0.5 - 1 = 0.106531, exp(1) - 1 - 1 = 0.718282.
    expected = torch.tensor([[0.106531, 0.718282]])
    torch.testing.assert_close(kl_penalty(LOGPROBS, REF_LOGPROBS), expected)


def test_kl_k3_is_clamped():
    # d = 15: exp(15) - 16 = 3.27e6 -> 10. d = -30 -> -20: exp(-20) + 20 - 1 = 19 -> 10.
    kl = kl_penalty(torch.tensor([0.0, 0.0]), torch.tensor([15.0, -30.0]), "k3")
    torch.testing.assert_close(kl, torch.tensor([10.0, 10.0]))


def test_unknown_kl_estimator_names_the_choices():
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'; choose one of: k1, k2, k3"):
        kl_penalty(LOGPROBS, REF_LOGPROBS, "k4")


# --- aggregation -----------------------------------------------------------------------------

LOSS_MAT = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])


@pytest.mark.parametrize(
    ("mode", "counts", "expected"),
    [
        ("token_mean", {}, 7.0 / 3.0),  # (1 + 2 + 4) / 3 tokens
        ("token_mean", {"num_tokens": 7}, 1.0),  # 7 / 7
        ("token_mean", {"num_tokens": torch.tensor(14.0)}, 0.5),  # 7 / 14
        ("seq_mean_token_sum", {}, 3.5),  # (3 + 4) / 2 seqs
        ("seq_mean_token_sum", {"num_seqs": 4}, 1.75),  # 7 / 4
        ("seq_mean_token_mean", {}, 2.75),  # (1.5 + 4) / 2 seqs
        ("seq_mean_token_mean", {"num_seqs": 4.0}, 1.375),  # 5.5 / 4
        ("seq_mean_token_sum_norm", {}, 7.0 / 6.0),  # 7 / (2 seqs * 3 columns)
        ("seq_mean_token_sum_norm", {"num_seqs": 4, "loss_scale_len": 7}, 0.25),  # 7 / 28
        ("seq_mean_token_sum_norm", {"loss_scale_len": torch.tensor(10.0)}, 0.35),  # 7 / 20
    ],
)
def test_aggregate_loss_by_hand(mode, counts, expected):
    assert aggregate_loss(LOSS_MAT, MASK, mode, **counts) == pytest.approx(expected)


@pytest.mark.parametrize(
    "mode", ["token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
)
def test_aggregate_loss_of_empty_mask_is_zero(mode):
    loss = aggregate_loss(LOSS_MAT, torch.zeros_like(MASK), mode)
    assert loss == 0.0


def test_unknown_aggregation_names_the_choices():
    with pytest.raises(ValueError, match="unknown loss aggregation 'sum'; choose one of: seq_"):
        aggregate_loss(LOSS_MAT, MASK, "sum")


# --- micro-batch equivalence -----------------------------------------------------------------

MODES = ["token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
LENGTHS = torch.tensor([5, 1, 3, 4, 2, 1])  # response lengths of a 6-sequence mini-batch
SPLITS = [[6], [2, 4], [1, 3, 2]]  # micro-batch sizes: one, two and three uneven pieces


def _mini_batch():
    torch.manual_seed(0)
    weights = torch.randn(6, 5, requires_grad=True)  # the "parameters", [B, T]
    targets = torch.randn(6, 5)
    mask = (torch.arange(5)[None, :] < LENGTHS[:, None]).long()  # [B, T]
    return weights, targets, mask


def _loss_mat(weights, targets):
    return (weights - targets) ** 2 * torch.sigmoid(weights)  # [B, T], non-linear per token


def _accumulate(mode, split, use_global_counts):
    """Backprops each micro-batch (trimmed to its own longest response) and sums."""
    weights, targets, mask = _mini_batch()
    global_counts = {"num_tokens": mask.sum(), "num_seqs": mask.shape[0], "loss_scale_len": 5}
    counts = global_counts if use_global_counts else {}
    total = torch.zeros(())
    for rows in torch.arange(6).split(split):
        width = int(LENGTHS[rows].max())
        loss = aggregate_loss(
            _loss_mat(weights[rows, :width], targets[rows, :width]),
            mask[rows, :width],
            mode,
            **counts,
        )
        loss.backward()
        total = total + loss.detach()
    return total, weights.grad


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("split", SPLITS, ids=str)
def test_micro_batches_with_global_counts_match_the_full_batch(mode, split):
    weights, targets, mask = _mini_batch()
    full_loss = aggregate_loss(_loss_mat(weights, targets), mask, mode)
    full_loss.backward()

    total, grad = _accumulate(mode, split, use_global_counts=True)
    assert torch.allclose(total, full_loss.detach(), atol=1e-6)
    assert torch.allclose(grad, weights.grad, atol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_micro_batches_with_local_counts_do_not_match(mode):
    # The control for the test above: each micro-batch normalising by its own counts
    # gives a different loss, which is the silent bug the global counts prevent.
    weights, targets, mask = _mini_batch()
    full_loss = aggregate_loss(_loss_mat(weights, targets), mask, mode)
    total, _ = _accumulate(mode, [1, 3, 2], use_global_counts=False)
    assert not torch.allclose(total, full_loss.detach(), atol=1e-3)
