"""The numeric and math rewards on a multi-turn response: the answer is what the model wrote
after the last tool response, never the tool's output (which is in ``Rollout.text``)."""

import pytest

from honing.models.tiny import build_tokenizer
from honing.rewards.math.numeric import TOOL_RESPONSE_END, numeric_reward
from honing.rewards.math.verifier import extract_answer
from honing.rollout.tools.calls import FALLBACK_RESPONSE, ToolResponses, ToolResult

CALL = (
    '<tool_call>{"name": "calculator", "arguments": {"expression": "96880963+752388"}}</tool_call>'
)


def response_text(tool_output: str, answer: str) -> str:
    """``Rollout.text`` of a call, its tool response as the turn loop appends it, and
    ``answer``: the tokens decoded without special tokens."""
    tokenizer = build_tokenizer(tool_tags=True)
    result = ToolResult("calculator", tool_output)
    ids = (
        tokenizer.encode(CALL, add_special_tokens=False)
        + ToolResponses(tokenizer).ids(CALL, [result])
        + tokenizer.encode(answer, add_special_tokens=False)
    )
    return tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize(
    ("tool_output", "answer", "score", "verdict"),
    [
        ("97633351", "97633351", 1.0, "correct"),
        ("97633351", "97633350", 0.0, "wrong"),
        ("97633351", "", 0.0, "no_answer"),  # stopped after the response: the tool's number
        ("\\boxed{97633351}", "97633350", 0.0, "wrong"),  # a box in the tool's output
        ("12", "97633351", 1.0, "correct"),
    ],
)
def test_the_answer_is_what_follows_the_last_tool_response(tool_output, answer, score, verdict):
    result = numeric_reward(response_text(tool_output, answer), "97633351")
    assert (result["score"], result["verdict"]) == (score, verdict)


@pytest.mark.parametrize(
    ("tool_output", "answer", "extracted"),
    [
        ("97633351", "97633351", "97633351"),
        ("97633351", "", None),  # stopped after the response: the tool's number is not it
        ("\\boxed{97633351}", "97633350", "97633350"),  # a box in the tool's output
        ("#### 12", "so 7", "7"),
    ],
)
def test_the_math_reward_reads_what_follows_the_last_tool_response(tool_output, answer, extracted):
    assert extract_answer(response_text(tool_output, answer)) == extracted


def test_the_marker_closes_the_rendered_tool_response():
    assert TOOL_RESPONSE_END in FALLBACK_RESPONSE
    assert response_text("1", "2").rstrip("2").rstrip().endswith(TOOL_RESPONSE_END)
