"""The saved-for-backward byte count: each storage once, parameters left out."""

import torch

from honing.trainer.memory import saved_bytes


def test_each_storage_counts_once_and_parameters_not_at_all():
    weight = torch.nn.Parameter(torch.randn(8, 4))
    x = torch.randn(16, 8, requires_grad=True)
    with saved_bytes([weight]) as saved:
        h = x @ weight  # saves x (16 x 8 floats) and the weight (left out)
        y = (h * h).sum() + x.t().cos().sum()  # h twice, then a view of x: counted already
    assert saved.bytes == (16 * 8 + 16 * 4) * 4
    assert saved.storages == 2
    y.backward()  # what was saved is handed back unchanged
    torch.testing.assert_close(weight.grad, x.detach().T @ (2 * h.detach()))


def test_nothing_is_counted_without_a_gradient():
    x = torch.randn(16, 8, requires_grad=True)
    with torch.no_grad(), saved_bytes() as saved:
        x.sin().sum()
    assert saved.bytes == 0
