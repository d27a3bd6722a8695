"""Equivalence of two normalised answers, exactly, in process: the verifier's fast path.

``fast_check`` parses both sides (``expr``) and compares them exactly: numbers,
fractions, surds and pi through ``exact``; expressions in variables by evaluation at
``POINTS_NEEDED`` seeded random rational points (Schwartz-Zippel: two different rational
functions agree at 3 random points with 21-bit numerators with negligible probability).
It returns ``None`` (undecided) for what it cannot read or bound.

Grading rules (those of a careful human grader):

- Exact ground truth (integer, fraction, surd, pi): the answer must equal it exactly; a
  decimal is read exactly, so ``0.5 == 1/2`` but ``0.333 != 1/3`` and ``6.2832 != 2\\pi``.
- Decimal ground truth (``3.14``): a decimal answer must equal it (relative tolerance 1e-9,
  so ``3.140`` is right and ``3.1416`` is not); an irrational exact answer (``\\pi``,
  ``\\sqrt{2}``) is right when it rounds to the ground truth at its number of decimals; a
  fraction is right when exactly equal, or, when it has no finite decimal expansion and the
  ground truth has at least 2 decimals, when it rounds to it (``1/3`` for ``0.33``, not
  ``2/7`` for ``0.3``).
- Percent is a unit: ``50\\%`` equals ``50``; it does not equal ``0.5``.
- Intervals and tuples: same brackets, same items in order; sets and bare comma lists:
  order-free; a wrong item or bracket is wrong.
- Words (4+ letters, several words, or yes/no and a few short words): equal ignoring case
  and spaces.
"""

from __future__ import annotations

import re
from decimal import Decimal, localcontext
from fractions import Fraction
from random import Random
from typing import Any

from honing.rewards.math import exact
from honing.rewards.math import expr as math_expr
from honing.rewards.math.exact import Unsupported

MAX_ANSWER_CHARS = 400
POINTS_NEEDED = 3
POINTS_TRIED = 8
PI = Fraction("3.14159265358979323846264338327950288419716939937510582097494459")
EULER = Fraction("2.71828182845904523536028747135266249775724709369995957496696762")
_WORDS_RE = re.compile(
    r"[A-Za-z]{4,}(?: [A-Za-z]+)*|[A-Za-z]+(?: [A-Za-z]+)+|(?i:yes|no|odd|all|one|two|six|ten)"
)


def fast_check(answer: str, truth: str) -> bool | None:
    """Whether the normalised ``answer`` equals the normalised ``truth``; ``None``: undecided.

    Exact and bounded (module docstring); ``None`` when either side is beyond the parser.
    """
    if len(answer) > MAX_ANSWER_CHARS or len(truth) > MAX_ANSWER_CHARS:
        return None
    if _WORDS_RE.fullmatch(truth):
        return answer.replace(" ", "").lower() == truth.replace(" ", "").lower()
    try:
        return _compare(math_expr.parse_answer(truth), math_expr.parse_answer(answer))
    except (Unsupported, ValueError, ZeroDivisionError, RecursionError):
        return None


def _compare(truth: tuple, answer: tuple) -> bool | None:
    if truth[0] == "expr" and answer[0] == "expr":
        return _items_equal(truth[1], answer[1])
    if truth[0] == "seq" and answer[0] == "seq":
        if truth[1:3] != answer[1:3] or len(truth[3]) != len(answer[3]):
            return False
        return _all(_items_equal(t, a) for t, a in zip(truth[3], answer[3], strict=True))
    as_set = {"set": lambda s: s[1], "expr": lambda s: [s[1]], "union": lambda s: s[1]}
    if truth[0] == "union" and answer[0] == "union":
        return _same_members(truth[1], answer[1], _compare)
    if truth[0] in ("set", "expr") and answer[0] in ("set", "expr"):
        return _same_members(as_set[truth[0]](truth), as_set[answer[0]](answer), _items_equal)
    return None


def _all(results: Any) -> bool | None:
    """``False`` if any is ``False``, else ``None`` if any is undecided, else ``True``."""
    results = list(results)
    if False in results:
        return False
    return None if None in results else True


def _same_members(truths: list, answers: list, equal: Any) -> bool | None:
    """Order-free equality of two collections (duplicates ignored)."""
    undecided = False
    for members, others, flip in ((truths, answers, False), (answers, truths, True)):
        for member in members:
            found = [equal(o, member) if flip else equal(member, o) for o in others]
            if True in found:
                continue
            if None not in found:
                return False
            undecided = True
    return None if undecided else True


def _items_equal(truth: tuple, answer: tuple) -> bool | None:
    """Equality of two scalar items (expressions or signed infinities)."""
    if truth[0] == "inf" or answer[0] == "inf":
        return truth == answer
    decimal_truth = _decimal_literal(truth)
    if decimal_truth is not None:
        return _matches_decimal(decimal_truth, answer)
    names = sorted(math_expr.variables(truth) | math_expr.variables(answer))
    agreed = 0
    rng = Random(0x5EED)
    for _ in range(POINTS_TRIED if names else 1):
        env = {
            name: Fraction(rng.randint(-(2**20), 2**20), rng.randint(1, 2**10)) for name in names
        }
        try:
            equal = math_expr.evaluate(truth, env) == math_expr.evaluate(answer, env)
        except ZeroDivisionError:
            continue
        if not equal:
            return None if "i" in names else False  # i may be the imaginary unit
        agreed += 1
        if agreed == (POINTS_NEEDED if names else 1):
            return True
    return None


def _decimal_literal(node: tuple) -> tuple[Fraction, int] | None:
    """``(value, decimals)`` when ``node`` is a (signed) number written with a decimal point."""
    sign = 1
    if node[0] == "neg":
        sign, node = -1, node[1]
    if node[0] != "num" or not node[2]:
        return None
    decimals = next(k for k in range(1, 400) if (node[1] * 10**k).denominator == 1 or k == 399)
    return sign * node[1], decimals


def _matches_decimal(truth: tuple[Fraction, int], answer: tuple) -> bool:
    """The decimal-ground-truth rule of the module docstring."""
    value, decimals = truth
    names = math_expr.variables(answer)
    if names - {"\\pi", "e"}:
        return False
    approximate = _numeric(math_expr.evaluate(answer, {"\\pi": PI, "e": EULER}))
    if math_expr.has_decimal(answer):
        return abs(approximate - value) <= Fraction(1, 10**9) * max(abs(value), 1)
    if not names:
        exact_value = math_expr.evaluate(answer, {})
        rational = exact.as_rational(exact_value)
        if rational == value:
            return True
        if rational is not None and (_terminates(rational) or decimals < 2):
            return False
    return abs(approximate - value) <= Fraction(1, 2 * 10**decimals)


def _terminates(number: Fraction) -> bool:
    """Whether ``number`` has a finite decimal expansion (denominator 2^a 5^b)."""
    denominator = number.denominator
    for prime in (2, 5):
        while denominator % prime == 0:
            denominator //= prime
    return denominator == 1


def _numeric(value: exact.Value) -> Fraction:
    """A 50-digit rational approximation of a value with roots."""
    with localcontext() as context:
        context.prec = 50
        return sum((c * Fraction(Decimal(d).sqrt()) for d, c in value.items()), start=Fraction(0))
