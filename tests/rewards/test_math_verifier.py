"""Math answer extraction, normalisation, fast-path equivalence and the labelled set."""

import json
import time
from pathlib import Path

import pytest

from honing.rewards.math.verifier import (
    MathVerifier,
    extract_answer,
    fast_check,
    math_reward,
    normalize_answer,
    verify_math,
)

LABELLED = Path(__file__).parent / "data" / "math_labelled.jsonl"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
        ("\\boxed{1} then \\boxed{{2}+{3}}", "{2}+{3}"),  # the last box, nested braces
        ("\\fbox{7}", "7"),
        ("hence \\boxed 5.", "5."),
        ("clips\n#### 1,234\n", "1,234"),
        ("Final Answer: The final answer is $\\frac{3}{4}$. I hope it is correct.", "\\frac{3}{4}"),
        ("The answer is 12 cookies. Check: 3*4.", "12"),  # one number in the sentence
        ("The answer is that there are 5 ways", "5"),
        ("The answer is $x^2$ since 4 > 3", "x^2"),
        ("**Final answer:** 4", "4"),
        ("x = -1.5", "x = -1.5"),  # a short response that is itself an answer
        ("2 + 2 = 4, so 4 apples remain", "4"),  # the last number
        ("no number here", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_extract_answer_without_last_number_fallback():
    assert extract_answer("it is 4", last_number_fallback=False) is None
    assert extract_answer("\\boxed{4}", last_number_fallback=False) == "4"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("$\\dfrac{3}{4}$", "\\frac{3}{4}"),
        ("\\left( 1, 2 \\right]", "( 1, 2 ]"),
        ("1,234,567", "1234567"),
        ("1{,}000", "1000"),
        ("5\\,\\text{cm}^2", "5"),
        ("12 dollars", "12"),
        ("\\$18.00.", "18.00"),
        ("90^\\circ", "90"),
        ("50\\%", "50"),
        ("\\text{(B)}", "(B)"),
        ("1, 234", "1, 234"),  # a list, not a thousands separator
    ],
)
def test_normalize_answer(text, expected):
    assert normalize_answer(text) == expected


@pytest.mark.parametrize(
    ("answer", "truth", "expected"),
    [
        ("0.5", "\\frac{1}{2}", True),
        ("0.333", "\\frac{1}{3}", False),  # exact truth: a decimal must be exact
        ("\\frac{1}{3}", "0.33", True),  # decimal truth: 1/3 rounds to it
        ("\\frac{2}{7}", "0.3", False),  # ... but not with a 1-decimal truth
        ("3.1416", "3.14", False),  # a decimal answer must equal a decimal truth
        ("2\\pi", "6.28", True),
        ("6.2832", "2\\pi", False),
        ("\\frac{1}{2^{99}}", "\\frac{1}{2^{98}}", False),
        ("1000001", "1000000", False),
        ("\\sqrt{12}", "2\\sqrt{3}", True),
        ("x^2+2x+1", "(x+1)^2", True),
        ("x^2+2x+2", "(x+1)^2", False),
        ("(1, 2)", "(1, 2]", False),
        ("\\{2, 1\\}", "1, 2", True),
        ("(2, 1)", "(1, 2)", False),
        ("50", "50", True),
        ("0.5", "50", False),  # percent is a unit (50\% normalises to 50)
        ("Yes", "yes", True),
        ("2", "\\sin x", None),  # beyond the fast path
        ("9^{9^{9^{9}}}", "1", None),  # refused, not computed
        ("(x+1)^{100000}", "1", None),
        ("3+4i", "(2+i)^2", None),  # i may be the imaginary unit: no fast "wrong"
    ],
)
def test_fast_check(answer, truth, expected):
    assert fast_check(answer, truth) is expected


@pytest.mark.alone
def test_fast_path_is_bounded():
    started = time.perf_counter()
    for answer in ("2^{10^{9}}", "10^{10^{10}}", "(1+\\sqrt{2})^{9999}", "1" * 5000):
        fast_check(answer, "1")
    assert time.perf_counter() - started < 1.0


def test_verify_math_result_shape():
    result = verify_math("so \\boxed{x=5}.", "5", slow_path=False)
    assert result == {
        "score": 1.0,
        "verdict": "correct",
        "reason": "equals '5'",
        "extracted": "x=5",
        "path": "fast",
    }
    assert json.loads(json.dumps(result)) == result
    assert verify_math("nothing", 5, slow_path=False)["verdict"] == "no_answer"
    assert verify_math("\\boxed{\\sin x}", "1", slow_path=False)["verdict"] == "unparsable"
    assert verify_math("it is 8", ["7", "8"], slow_path=False)["score"] == 1.0  # any of
    assert verify_math("\\boxed{5}", 5.0, slow_path=False)["score"] == 1.0


def test_math_reward_accepts_context():
    result = math_reward("#### 72", 72, prompt="p", data_source="gsm8k", extra_info={})
    assert (result["score"], result["path"]) == (1.0, "fast")


def test_labelled_set_agreement():
    """>= 97% agreement with the hand labels, and no false positive on a near miss."""
    rows = [json.loads(line) for line in LABELLED.read_text().splitlines()]
    assert len(rows) >= 200
    items = [{"response": r["response"], "ground_truth": r["ground_truth"]} for r in rows]
    with MathVerifier(workers=2, timeout_s=5.0) as verifier:
        results = verifier.score_batch(items)
    said = [result["score"] == 1.0 for result in results]
    agreement = sum(s == bool(r["label"]) for s, r in zip(said, rows, strict=True)) / len(rows)
    false_positives = [r for s, r in zip(said, rows, strict=True) if s and r["near_miss"]]
    assert agreement >= 0.97
    assert false_positives == []
