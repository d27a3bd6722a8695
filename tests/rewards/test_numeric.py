"""Answer extraction, number parsing and the numeric / format rewards."""

from fractions import Fraction

import pytest

from honing.errors import RewardError
from honing.rewards.math.numeric import extract_answer, format_reward, numeric_reward, parse_number


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so the result is \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("first \\boxed{3}, then \\boxed{{4}+{5}}", "{4}+{5}"),  # last box, nested braces
        ("\\boxed{5} is wrong; #### 6", "5"),  # a box beats ####
        ("Natalia sold 48 clips.\n#### 1,234", "1,234"),
        ("#### $72", "72"),
        ("3 apples plus 4. The answer is -7.", "-7"),
        ("THE ANSWER IS 12 since 3*4", "12"),  # "the answer is" beats the last number
        ("I think 5-3 leaves 2 and then 2.5 remain", "2.5"),
        ("x=-3", "-3"),
        ("5-3", "3"),  # a minus after a digit is an operator
        ("half is 3/4", "3/4"),
        ("no digits here", None),
        ("unclosed \\boxed{7 and 8", "8"),  # an unclosed box is ignored
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("42", Fraction(42)),
        ("-3.5", Fraction(-7, 2)),
        ("1,234", Fraction(1234)),
        ("1,234.5", Fraction(2469, 2)),
        ("3/4", Fraction(3, 4)),
        ("\\frac{3}{4}", Fraction(3, 4)),
        ("-\\dfrac{1}{2}", Fraction(-1, 2)),
        ("$ 12 $", Fraction(12)),
        ("7.", Fraction(7)),
        ("1e-3", Fraction(1, 1000)),
        ("1/0", None),
        ("1,23", None),
        ("x = 5", None),
        ("", None),
        ("1_000", None),
    ],
)
def test_parse_number(text, expected):
    assert parse_number(text) == expected


@pytest.mark.parametrize(
    ("response", "truth", "score", "verdict"),
    [
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0, "correct"),
        ("#### 1,234", "1234", 1.0, "correct"),
        ("The answer is -7.", -7, 1.0, "correct"),
        ("about 0.3333333", "1/3", 1.0, "correct"),  # decimal: relative tolerance 1e-6
        ("1000001", "1000000", 0.0, "wrong"),  # integers: exact
        ("0.334", "1/3", 0.0, "wrong"),
        ("\\boxed{x}", "3", 0.0, "wrong"),
        ("no digits here", "3", 0.0, "no_answer"),
        ("it is 8", ["7", "8"], 1.0, "correct"),  # any of several ground truths
    ],
)
def test_numeric_reward(response, truth, score, verdict):
    result = numeric_reward(response, truth, prompt="p", data_source="d", extra_info={})
    assert result["score"] == score
    assert result["verdict"] == verdict


def test_numeric_reward_reports_extracted_text():
    assert numeric_reward("#### 1,234", "1234")["extracted"] == "1,234"
    assert numeric_reward("nothing", "1")["extracted"] is None


def test_non_numeric_ground_truth_is_a_reward_error():
    with pytest.raises(RewardError, match="ground truth 'Paris' is not a number"):
        numeric_reward("42", "Paris")


@pytest.mark.parametrize(
    ("response", "score"),
    [
        ("43", 1.0),
        ("  -12\n", 1.0),
        ("1,234", 1.0),
        ("The answer is 43", 0.0),
        ("43.", 0.0),
        ("", 0.0),
    ],
)
def test_format_reward(response, score):
    assert format_reward(response, "43")["score"] == score
