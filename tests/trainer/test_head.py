"""The fused LM head + logprob against autograd through the plain formulas."""

import pytest
import torch

from honing.algorithms import entropy_from_logits, logprobs_from_logits
from honing.trainer.head import head_logprobs


def _reference(hidden, weight, labels, temperature):
    logits = (hidden @ weight.T).float() / temperature
    return logprobs_from_logits(logits, labels), entropy_from_logits(logits)


@pytest.mark.parametrize("chunk", [1, 3, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_values_and_gradients_match_autograd(chunk, temperature):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(7, 5, generator=gen, requires_grad=True)
    weight = torch.randn(11, 5, generator=gen, requires_grad=True)
    labels = torch.randint(0, 11, (7,), generator=gen)
    grad_lp, grad_ent = torch.randn(2, 7, generator=gen)

    lp, ent = _reference(hidden, weight, labels, temperature)
    want = torch.autograd.grad((lp * grad_lp).sum() + (ent * grad_ent).sum(), [hidden, weight])
    got_lp, got_ent = head_logprobs(
        hidden,
        weight,
        labels,
        temperature=temperature,
        with_entropy=True,
        entropy_grad=True,
        chunk_tokens=chunk,
    )
    got = torch.autograd.grad(
        (got_lp * grad_lp).sum() + (got_ent * grad_ent).sum(), [hidden, weight]
    )
    torch.testing.assert_close(got_lp, lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(got_ent, ent, atol=1e-5, rtol=0)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_entropy_without_grad_is_detached_and_logprob_only_backward():
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(6, 4, generator=gen, requires_grad=True)
    weight = torch.randn(9, 4, generator=gen)  # frozen, as a reference model's head
    labels = torch.randint(0, 9, (6,), generator=gen)
    lp, ent = head_logprobs(hidden, weight, labels, with_entropy=True, chunk_tokens=4)
    assert lp.requires_grad and not ent.requires_grad
    (grad,) = torch.autograd.grad(lp.sum(), [hidden])
    hidden_ref = hidden.detach().clone().requires_grad_()
    want_lp, _ = _reference(hidden_ref, weight, labels, 1.0)
    (want,) = torch.autograd.grad(want_lp.sum(), [hidden_ref])
    torch.testing.assert_close(grad, want, atol=1e-5, rtol=1e-5)
    assert head_logprobs(hidden, weight, labels)[1] is None
