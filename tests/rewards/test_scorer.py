"""Scorer: result normalisation, format bonus, context passing and failure policies."""

import math

import pytest

from honing.errors import RewardError
from honing.rewards.math.numeric import format_reward, numeric_reward
from honing.rewards.scorer import Scorer
from honing.types import Prompt, Rollout

PROMPTS = {
    "p1": Prompt(id="p1", prompt="18+25=", ground_truth="43", data_source="arithmetic"),
    "p2": Prompt(
        id="p2",
        prompt=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
        ground_truth="4",
        data_source="chat",
        extra_info={"index": 2},
    ),
}


def rollout(prompt_id, text):
    return Rollout(
        prompt_id=prompt_id,
        group_index=0,
        prompt_ids=[1],
        response_ids=[2],
        behaviour_logprobs=[-0.5],
        finish_reason="stop",
        weight_version=0,
        text=text,
    )


def test_numeric_scores_with_details():
    scorer = Scorer(numeric_reward)
    scores = scorer.score(PROMPTS, [rollout("p1", "43"), rollout("p1", "33"), rollout("p2", "")])
    assert [score.reward for score in scores] == [1.0, 0.0, 0.0]
    assert all(score.ok for score in scores)
    assert scores[0].details == {"extracted": "43", "verdict": "correct"}
    assert scores[2].details["verdict"] == "no_answer"
    assert len(scorer.last_latencies_ms) == 3
    assert all(latency >= 0.0 for latency in scorer.last_latencies_ms)


def test_format_bonus_is_weighted_and_recorded():
    scorer = Scorer(numeric_reward, format_fn=format_reward, format_weight=0.1)
    correct_bare, wrong_bare, correct_wordy = scorer.score(
        PROMPTS, [rollout("p1", "43"), rollout("p1", "33"), rollout("p1", "It is 43")]
    )
    assert correct_bare.reward == pytest.approx(1.1)
    assert wrong_bare.reward == pytest.approx(0.1)
    assert correct_wordy.reward == pytest.approx(1.0)
    assert (correct_bare.details["format"], correct_wordy.details["format"]) == (1.0, 0.0)


def test_context_is_passed_by_keyword():
    seen = []

    def spy(response, ground_truth, *, prompt, data_source, extra_info):
        seen.append((response, ground_truth, prompt, data_source, extra_info))
        return 0.5

    scorer = Scorer(spy)
    scores = scorer.score(PROMPTS, [rollout("p2", "4"), rollout("p1", "43")], {"p1": "<r>18+25="})
    assert [score.reward for score in scores] == [0.5, 0.5]
    assert seen == [
        ("4", "4", "Be brief.\n2+2?", "chat", {"index": 2}),  # unrendered: contents joined
        ("43", "43", "<r>18+25=", "arithmetic", {}),
    ]


def test_float_like_results_are_accepted():
    scorer = Scorer(lambda response, ground_truth, **context: True)
    assert scorer.score(PROMPTS, [rollout("p1", "x")])[0].reward == 1.0


def boom(response, ground_truth, **context):
    raise ValueError("bad\ninput")


def test_error_policy_raises_one_line_naming_function():
    scorer = Scorer(boom, on_error="fail")
    with pytest.raises(RewardError) as error:
        scorer.score(PROMPTS, [rollout("p1", "43")])
    message = str(error.value)
    assert "test_scorer.boom raised ValueError: bad input" in message
    assert "prompt p1" in message
    assert "\n" not in message


def test_zero_policy_records_the_error():
    (score,) = Scorer(boom, on_error="zero").score(PROMPTS, [rollout("p1", "43")])
    assert score.reward == 0.0
    assert not score.ok
    assert "ValueError: bad input" in score.details["error"]


def test_drop_policy_gives_nan():
    scores = Scorer(boom, on_error="drop").score(PROMPTS, [rollout("p1", "1"), rollout("p2", "2")])
    assert all(math.isnan(score.reward) and not score.ok for score in scores)


@pytest.mark.parametrize(
    ("returned", "reason"),
    [
        ("1.0", "returned str '1.0'"),
        (None, "returned NoneType None"),
        (float("nan"), "returned nan"),
        ({"verdict": "correct"}, "dict without 'score'"),
        ({"score": "high"}, "returned str 'high'"),
    ],
)
def test_bad_returns_are_failures(returned, reason):
    scorer = Scorer(lambda response, ground_truth, **context: returned, on_error="zero")
    (score,) = scorer.score(PROMPTS, [rollout("p1", "43")])
    assert (score.reward, score.ok) == (0.0, False)
    assert reason in score.details["error"]


def test_failing_format_fn_is_a_failure():
    scorer = Scorer(numeric_reward, format_fn=boom, format_weight=0.5, on_error="zero")
    (score,) = scorer.score(PROMPTS, [rollout("p1", "43")])
    assert (score.reward, score.ok) == (0.0, False)
    assert "boom raised" in score.details["error"]


def test_unknown_policy_is_rejected():
    with pytest.raises(RewardError, match="reward.on_error"):
        Scorer(numeric_reward, on_error="ignore")
