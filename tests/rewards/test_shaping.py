import pytest

from honing.rewards.shaping import overlong_penalty, tool_penalty


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


def test_tool_penalty_by_hand():
    calls = [{"error": False}, {"error": True}, {"error": False}, {"error": True}]
    assert tool_penalty(calls, 0.5, 0.1, free_calls=1) == -0.5 * 2 - 0.1 * 3
    assert tool_penalty(calls, 0.0, 0.0, free_calls=1) == 0.0
    assert tool_penalty(None, 0.5, 0.1, free_calls=1) == 0.0  # one turn: no calls
    assert tool_penalty(calls[:1], 0.5, 0.1, free_calls=1) == 0.0


def test_the_tool_penalty_reaches_the_reward_and_its_details():
    from honing.config import build_config
    from honing.pipeline.collect import _shape
    from honing.types import Rollout, Score

    config = build_config({"reward.tool_error_penalty": 0.25, "reward.tool_call_penalty": 0.1})
    calls = [{"error": True}, {"error": False}, {"error": False}]
    rollouts = [
        Rollout("p", 0, [1], [2], [0.0], "stop", 0, "", tool_calls=calls),
        Rollout("p", 0, [1], [2], [0.0], "stop", 0, ""),
    ]
    scores = [Score(1.0), Score(1.0)]
    _shape(config, rollouts, scores)
    assert scores[0].reward == 1.0 - 0.25 - 0.2 and scores[0].details["tool_penalty"] == -0.45
    assert scores[1].reward == 1.0 and "tool_penalty" not in scores[1].details
