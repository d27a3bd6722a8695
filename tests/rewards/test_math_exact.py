"""Exact arithmetic with square roots: canonical forms, rationalising, bounds."""

from fractions import Fraction

import pytest

from honing.rewards.math import exact
from honing.rewards.math.exact import Unsupported


def test_roots_reduce_to_a_canonical_form():
    assert exact.root(exact.constant(12), 2) == {3: Fraction(2)}  # sqrt(12) = 2 sqrt(3)
    assert exact.root(exact.constant(Fraction(1, 2)), 2) == {2: Fraction(1, 2)}
    assert exact.root(exact.constant(49), 2) == {1: Fraction(7)}
    assert exact.root(exact.constant(8), 3) == {1: Fraction(2)}
    # 10007 is prime and beyond the cube root: the cofactor-is-a-square branch.
    assert exact.root(exact.constant(2 * 10007**2), 2) == {2: Fraction(10007)}


def test_products_of_roots():
    sqrt2, sqrt6 = exact.root(exact.constant(2), 2), exact.root(exact.constant(6), 2)
    assert exact.multiply(sqrt2, sqrt6) == {3: Fraction(2)}  # sqrt(12)
    assert exact.multiply(sqrt2, sqrt2) == {1: Fraction(2)}


def test_inverse_rationalises_sums_of_roots():
    one_plus_sqrt2 = {1: Fraction(1), 2: Fraction(1)}
    assert exact.inverse(one_plus_sqrt2) == {1: Fraction(-1), 2: Fraction(1)}  # sqrt2 - 1
    two_roots = {2: Fraction(1), 3: Fraction(1)}  # 1/(sqrt2 + sqrt3) = sqrt3 - sqrt2
    assert exact.inverse(two_roots) == {3: Fraction(1), 2: Fraction(-1)}
    with pytest.raises(ZeroDivisionError):
        exact.inverse({})


def test_powers():
    assert exact.power(exact.constant(2), Fraction(-3)) == {1: Fraction(1, 8)}
    assert exact.power(exact.constant(4), Fraction(5, 2)) == {1: Fraction(32)}
    assert exact.power(exact.constant(2), Fraction(1, 2)) == {2: Fraction(1)}


@pytest.mark.parametrize(
    "call",
    [
        lambda: exact.power(exact.constant(9), Fraction(10**9)),  # exponent cap
        lambda: exact.power(exact.constant(3), Fraction(50_000 // 2)),  # result-size cap
        lambda: exact.root(exact.constant(-4), 2),  # complex
        lambda: exact.root(exact.constant(10**13 + 1), 2),  # radicand cap
        lambda: exact.root(exact.constant(9), 3),  # inexact cube root
        lambda: exact.factorial(exact.constant(10**6)),
    ],
)
def test_limits_raise_unsupported(call):
    with pytest.raises(Unsupported):
        call()
