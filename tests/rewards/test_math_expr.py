"""The fast path's LaTeX answer parser and exact evaluator."""

from fractions import Fraction

import pytest

from honing.rewards.math.exact import Unsupported
from honing.rewards.math.expr import evaluate, parse_answer, variables


def value(text, **env):
    kind, node = parse_answer(text)
    assert kind == "expr"
    return evaluate(node, {name: Fraction(v) for name, v in env.items()})


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("\\frac12", {1: Fraction(1, 2)}),
        ("\\frac123", {1: Fraction(3, 2)}),  # \frac{1}{2} * 3, as LaTeX reads it
        ("x^23", {1: Fraction(12)}),  # x^2 * 3 at x = 2
        ("2\\frac{1}{2}", {1: Fraction(5, 2)}),  # a mixed number
        ("2\\sqrt{3}", {3: Fraction(2)}),
        ("\\sqrt2", {2: Fraction(1)}),
        ("-x^2", {1: Fraction(-4)}),
        ("3(x+1)", {1: Fraction(9)}),
        ("2^{-3}", {1: Fraction(1, 8)}),
        ("\\binom{5}{2}", {1: Fraction(10)}),
        ("4!", {1: Fraction(24)}),
        ("1/2/2", {1: Fraction(1, 4)}),
        ("y = 7", {1: Fraction(7)}),
        ("\\sqrt[3]{27}", {1: Fraction(3)}),
    ],
)
def test_evaluate(text, expected):
    assert value(text, x=2) == expected


def test_structures():
    assert parse_answer("(1, 2]")[:3] == ("seq", "(", "]")
    assert parse_answer("\\{1, 2\\}")[0] == "set"
    assert parse_answer("1, 2")[0] == "set"
    assert parse_answer("(-\\infty, 0)")[3][0] == ("inf", -1)
    assert [part[0] for part in parse_answer("(0,1)\\cup[2,3]")[1]] == ["seq", "seq"]
    assert parse_answer("(5)")[0] == "expr"  # brackets without a comma group


def test_variables():
    assert variables(parse_answer("\\pi r^2 + x_1")) == {"\\pi", "r", "x_1"}


@pytest.mark.parametrize(
    "text",
    ["\\sin x", "x^y", "2^{10^{9}}", "x^2+y^2=1", "a \\le b", "|x|", "(" * 60 + "1" + ")" * 60],
)
def test_beyond_the_fast_path(text):
    with pytest.raises(Unsupported):
        kind, node = parse_answer(text)
        evaluate(node, {"x": Fraction(2), "y": Fraction(3), "a": 1, "b": 2})
