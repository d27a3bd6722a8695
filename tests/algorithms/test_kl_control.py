import pytest

from honing.algorithms.kl_control import KLController


def test_fixed_never_moves():
    ctrl = KLController(0.05, "fixed")
    ctrl.update(current_kl=3.0, samples=1000)
    assert ctrl.value == 0.05


def test_adaptive_raises_beta_when_kl_is_above_target():
    ctrl = KLController(0.1, "adaptive", target=0.1, horizon=1000)
    ctrl.update(current_kl=0.11, samples=100)  # error = 0.1 -> beta * (1 + 0.1 * 0.1)
    assert ctrl.value == pytest.approx(0.1 * 1.01)


def test_adaptive_error_is_clipped():
    ctrl = KLController(0.1, "adaptive", target=0.1, horizon=1000)
    ctrl.update(current_kl=0.0, samples=500)  # error clipped to -0.2 -> beta * (1 - 0.1)
    assert ctrl.value == pytest.approx(0.09)


def test_unknown_kind():
    with pytest.raises(ValueError, match="fixed or adaptive"):
        KLController(0.1, "pid").update(0.2, 1)
