"""Numeric answer checking: find the final answer in a response and compare it to a number.

``extract_answer`` looks, in order of preference, for the last ``\\boxed{...}`` (nested
braces allowed), the last ``#### <number>`` (GSM8K style), the last "the answer is <number>",
and finally the last number anywhere in the text, all in what follows the last tool response
(``</tool_response>``, a multi-turn response's tool output is in its text: the answer is the
model's, never the tool's). ``parse_number`` reads integers,
decimals, thousands separators (``1,234``), simple fractions (``3/4``) and LaTeX fractions
(``\\frac{3}{4}``) into an exact ``Fraction``.

Limits: no units, percentages, scientific words or symbolic answers (``\\sqrt{2}``, ``x=5``
inside a box is not a number); a ``-`` right after a digit or letter is read as an operator,
not a sign (``5-3`` ends in ``3``).
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

from honing.errors import RewardError

RELATIVE_TOLERANCE = Fraction(1, 10**6)
# Where a Hermes tool response ends (rollout/tools/calls.FALLBACK_RESPONSE, chat templates).
TOOL_RESPONSE_END = "</tool_response>"

# A number inside prose: optional sign (not after a word or bracket, where "-" is an
# operator), thousands groups or plain digits, optional decimals, optional "/denominator".
_NUMBER = (
    r"(?:(?<![\w)\]])[-+])?"
    r"(?:(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)"
    r"(?:/\d+)?"
)
_NUMBER_RE = re.compile(_NUMBER)
_HASHES_RE = re.compile(r"####\s*\\?\$?\s*(" + _NUMBER + ")")
_ANSWER_IS_RE = re.compile(
    r"the (?:final )?answer is\s*:?\s*\\?\$?\s*(" + _NUMBER + ")", re.IGNORECASE
)
_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_PLAIN_NUMBER_RE = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
_THOUSANDS_RE = re.compile(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_DECIMAL_RE = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")
_LATEX_FRACTION_RE = re.compile(r"([-+]?)\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}")


def extract_answer(text: str) -> str | None:
    """The final answer in ``text`` as written, or ``None`` when there is none.

    Examples: ``"so \\boxed{\\frac{1}{2}}"`` -> ``"\\frac{1}{2}"``; ``"#### 1,234"`` ->
    ``"1,234"``; ``"The answer is -7."`` -> ``"-7"``; ``"no digits here"`` -> ``None``;
    ``"<tool_response>\\n42\\n</tool_response>\\n"`` -> ``None`` (the model gave no answer).
    """
    text = text.rpartition(TOOL_RESPONSE_END)[2]
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    for pattern in (_HASHES_RE, _ANSWER_IS_RE):
        matches = pattern.findall(text)
        if matches:
            return matches[-1]
    numbers = _NUMBER_RE.findall(text)
    return numbers[-1] if numbers else None


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` whose braces close, stripped."""
    for match in reversed(list(_BOXED_RE.finditer(text))):
        depth = 1
        for index in range(match.end(), len(text)):
            depth += {"{": 1, "}": -1}.get(text[index], 0)
            if depth == 0:
                return text[match.end() : index].strip()
    return None


def parse_number(text: str) -> Fraction | None:
    """Read ``text`` as an exact number, or ``None`` when it is not one.

    Accepts ``42``, ``-3.5``, ``1,234``, ``1e-3``, ``3/4``, ``\\frac{3}{4}`` (also
    ``\\dfrac``/``\\tfrac``, with a leading sign), surrounded by ``$`` signs or whitespace,
    with a trailing full stop. A zero denominator gives ``None``.
    """
    cleaned = text
    for noise in ("\\$", "$", "\\!", "\\,"):
        cleaned = cleaned.replace(noise, "")
    cleaned = "".join(cleaned.split()).rstrip(".")
    fraction = _LATEX_FRACTION_RE.fullmatch(cleaned)
    if fraction:
        sign, numerator, denominator = fraction.groups()
        value = _divide(_parse_decimal(numerator), _parse_decimal(denominator))
        return -value if value is not None and sign == "-" else value
    if "/" in cleaned:
        numerator, _, denominator = cleaned.partition("/")
        return _divide(_parse_decimal(numerator), _parse_decimal(denominator))
    return _parse_decimal(cleaned)


def _parse_decimal(text: str) -> Fraction | None:
    if _THOUSANDS_RE.fullmatch(text):
        text = text.replace(",", "")
    return Fraction(text) if _DECIMAL_RE.fullmatch(text) else None


def _divide(numerator: Fraction | None, denominator: Fraction | None) -> Fraction | None:
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def _is_decimal(text: str) -> bool:
    """Whether a number was written approximately (decimals or exponent)."""
    return "." in text or "e" in text.lower()


def _numbers_match(predicted: str, truth: str) -> bool:
    """Exact equality, or relative tolerance when either side is written as a decimal."""
    predicted_value, truth_value = parse_number(predicted), parse_number(truth)
    if predicted_value is None or truth_value is None:
        return False
    if predicted_value == truth_value:
        return True
    if not (_is_decimal(predicted) or _is_decimal(truth)):
        return False
    scale = max(abs(predicted_value), abs(truth_value))
    return abs(predicted_value - truth_value) <= RELATIVE_TOLERANCE * scale


def numeric_reward(response: str, ground_truth: Any, **context: Any) -> dict[str, Any]:
    """1.0 when the response's final answer equals the ground truth as a number.

    Args:
        response: the model's completion.
        ground_truth: a number or numeric string; a list/tuple means any of them is right.
        **context: ignored (prompt, data_source, extra_info).

    Returns:
        ``{"score": 1.0 | 0.0, "extracted": str | None, "verdict": "correct" | "wrong" |
        "no_answer"}``.

    Raises:
        RewardError: the ground truth is not a number (a data problem, not a wrong answer).
    """
    truths = list(ground_truth) if isinstance(ground_truth, (list, tuple)) else [ground_truth]
    truth_texts = [str(truth) for truth in truths]
    for truth in truth_texts:
        if parse_number(truth) is None:
            raise RewardError(
                f"ground truth {truth!r} is not a number; the 'numeric' reward expects "
                "an integer, decimal or fraction"
            )
    extracted = extract_answer(response)
    if extracted is None:
        return {"score": 0.0, "extracted": None, "verdict": "no_answer"}
    correct = any(_numbers_match(extracted, truth) for truth in truth_texts)
    return {
        "score": 1.0 if correct else 0.0,
        "extracted": extracted,
        "verdict": "correct" if correct else "wrong",
    }


def format_reward(response: str, ground_truth: Any, **context: Any) -> dict[str, Any]:
    """1.0 when the whole response (stripped) is a plain number, else 0.0.

    The optional format reward of the built-in arithmetic task (``reward.format_weight``):
    it pays for answering with just the digits, whatever their value. ``ground_truth`` and
    ``context`` are ignored.
    """
    formatted = _PLAIN_NUMBER_RE.fullmatch(response.strip()) is not None
    return {"score": 1.0 if formatted else 0.0}
