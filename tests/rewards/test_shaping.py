import pytest

from honing.rewards.shaping import overlong_penalty


@pytest.mark.parametrize(
    ("length", "expected"),
    [
        (10, 0.0),  # well inside
        (12, 0.0),  # exactly max - buffer = 16 - 4
        (13, -0.25),  # 1 of 4 buffer tokens used, factor 1
        (14, -0.5),
        (16, -1.0),  # at the limit
        (20, -1.0),  # beyond (cannot happen with the engine, still bounded)
    ],
)
def test_overlong_penalty_by_hand(length, expected):
    assert overlong_penalty(length, max_length=16, buffer_len=4, factor=1.0) == expected


def test_no_buffer_no_penalty():
    assert overlong_penalty(100, max_length=16, buffer_len=0, factor=1.0) == 0.0


def test_factor_scales():
    assert overlong_penalty(14, max_length=16, buffer_len=4, factor=0.5) == -0.25
