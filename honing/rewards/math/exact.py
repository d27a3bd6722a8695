"""Exact arithmetic for the math verifier's fast path: rationals with square roots.

A ``Value`` is a finite sum ``sum(c_d * sqrt(d))`` kept as ``{d: c_d}`` with ``d`` a
squarefree positive integer (``1`` for the rational part) and ``c_d`` a non-zero
``Fraction``; ``{}`` is zero. Square roots of distinct squarefree integers are linearly
independent over the rationals, so this form is canonical: two values are equal exactly when
their dicts are equal (``2*sqrt(3)`` and ``sqrt(12)`` both become ``{3: 2}``). Division by a
sum of roots rationalises the denominator one prime at a time.

Everything is bounded, so that nothing in-process can run away: coefficients may not exceed
``MAX_BITS`` bits, a value may not have more than ``MAX_TERMS`` terms, exponents may not
exceed ``MAX_EXPONENT``, radicands may not exceed ``MAX_RADICAND`` (so that the squarefree
part is found by trial division). Anything beyond raises ``Unsupported``, which sends the
check to the slow path (math-verify in a killable worker). Limits: no nested roots
(``sqrt(1 + sqrt(2))``), no roots of negative numbers, cube and higher roots only when exact.
"""

from __future__ import annotations

from fractions import Fraction
from math import gcd, isqrt

Value = dict[int, Fraction]

MAX_BITS = 20_000
MAX_TERMS = 64
MAX_EXPONENT = 10_000
MAX_RADICAND = 10**12
MAX_FACTORIAL = 1_000


class Unsupported(Exception):
    """The fast path cannot decide this input; the slow path should."""


def constant(number: Fraction | int) -> Value:
    """The rational ``number`` as a ``Value``."""
    return {1: Fraction(number)} if number else {}


def as_rational(value: Value) -> Fraction | None:
    """The value as a ``Fraction`` when it has no root part, else ``None``."""
    if not value:
        return Fraction(0)
    if len(value) == 1 and 1 in value:
        return value[1]
    return None


def _checked(value: Value) -> Value:
    if len(value) > MAX_TERMS:
        raise Unsupported(f"more than {MAX_TERMS} root terms")
    for coefficient in value.values():
        bits = max(coefficient.numerator.bit_length(), coefficient.denominator.bit_length())
        if bits > MAX_BITS:
            raise Unsupported(f"a number of more than {MAX_BITS} bits")
    return value


def add(left: Value, right: Value) -> Value:
    total = dict(left)
    for radicand, coefficient in right.items():
        summed = total.get(radicand, 0) + coefficient
        if summed:
            total[radicand] = summed
        else:
            total.pop(radicand, None)
    return _checked(total)


def negate(value: Value) -> Value:
    return {radicand: -coefficient for radicand, coefficient in value.items()}


def multiply(left: Value, right: Value) -> Value:
    """Product; ``sqrt(a) * sqrt(b) = g * sqrt(a*b/g^2)`` with ``g = gcd(a, b)``."""
    product: Value = {}
    for radicand_a, coefficient_a in left.items():
        for radicand_b, coefficient_b in right.items():
            common = gcd(radicand_a, radicand_b)
            radicand = (radicand_a // common) * (radicand_b // common)
            term = coefficient_a * coefficient_b * common
            summed = product.get(radicand, 0) + term
            if summed:
                product[radicand] = summed
            else:
                product.pop(radicand, None)
    return _checked(product)


def inverse(value: Value) -> Value:
    """``1 / value``, rationalising: ``1/(A + B*sqrt(p)) = (A - B*sqrt(p)) / (A^2 - p*B^2)``.

    Raises:
        ZeroDivisionError: the value is zero.
        Unsupported: a radicand too large to factor quickly.
    """
    if not value:
        raise ZeroDivisionError("division by zero")
    if len(value) == 1:
        ((radicand, coefficient),) = value.items()
        return {radicand: 1 / (coefficient * radicand)}
    prime = _smallest_prime_factor(max(value))
    with_prime = {d // prime: c for d, c in value.items() if d % prime == 0}
    without_prime = {d: c for d, c in value.items() if d % prime}
    conjugate = add(without_prime, negate(multiply(with_prime, {prime: Fraction(1)})))
    rationalised = multiply(value, conjugate)  # free of sqrt(prime)
    return multiply(conjugate, inverse(rationalised))


def power(base: Value, exponent: Fraction) -> Value:
    """``base ** exponent`` for an integer exponent, or a root that stays exact.

    Raises:
        Unsupported: exponent too large, result too large, or a fractional power that is not
            a square root of a rational or an exact higher root.
        ZeroDivisionError: zero to a negative power.
    """
    if abs(exponent) > MAX_EXPONENT:
        raise Unsupported(f"an exponent beyond {MAX_EXPONENT}")
    if exponent.denominator != 1:
        return power(root(base, exponent.denominator), Fraction(exponent.numerator))
    count = int(exponent)
    if count < 0:
        return power(inverse(base), Fraction(-count))
    rational = as_rational(base)
    if rational is not None and rational not in (0, 1, -1):
        bits = max(rational.numerator.bit_length(), rational.denominator.bit_length())
        if bits * count > MAX_BITS:
            raise Unsupported(f"a power of more than {MAX_BITS} bits")
    result, square = constant(1), base
    while count:
        if count & 1:
            result = multiply(result, square)
        count >>= 1
        if count:
            square = multiply(square, square)
    return result


def root(value: Value, degree: int) -> Value:
    """The principal ``degree``-th root of a non-negative rational value (exact only).

    Raises:
        Unsupported: the value has roots in it, is negative (complex), or a higher root is
            not exact.
    """
    rational = as_rational(value)
    if rational is None or rational < 0:
        raise Unsupported("a root of a root or of a negative number")
    if degree == 1 or rational == 0:
        return constant(rational)
    if degree == 2:
        radicand = rational.numerator * rational.denominator
        if radicand > MAX_RADICAND:
            raise Unsupported(f"a square root of a number beyond {MAX_RADICAND}")
        square, squarefree = _split_square(radicand)
        return {squarefree: Fraction(square, rational.denominator)}
    numerator = _exact_root(rational.numerator, degree)
    denominator = _exact_root(rational.denominator, degree)
    return constant(Fraction(numerator, denominator))


def factorial(value: Value) -> Value:
    rational = as_rational(value)
    if rational is None or rational.denominator != 1 or not 0 <= rational <= MAX_FACTORIAL:
        raise Unsupported(f"a factorial of something other than 0..{MAX_FACTORIAL}")
    result = 1
    for factor in range(2, int(rational) + 1):
        result *= factor
    return constant(result)


def _exact_root(number: int, degree: int) -> int:
    if number.bit_length() > 2_000:
        raise Unsupported("a higher root of a large number")
    guess = round(number ** (1 / degree)) if number.bit_length() < 1_000 else 0
    for candidate in (guess - 1, guess, guess + 1):
        if candidate >= 0 and candidate**degree == number:
            return candidate
    raise Unsupported(f"a {degree}-th root that is not exact")


def _split_square(number: int) -> tuple[int, int]:
    """``(s, d)`` with ``number = s^2 * d`` and ``d`` squarefree, for ``number <= 10^12``.

    Trial division up to the cube root leaves a cofactor that is 1, a prime, a prime squared
    or a product of two distinct primes: only the third is a square.
    """
    square, squarefree, factor = 1, 1, 2
    while factor**3 <= number:
        while number % (factor * factor) == 0:
            number //= factor * factor
            square *= factor
        if number % factor == 0:
            number //= factor
            squarefree *= factor
        factor += 1
    cofactor_root = isqrt(number)
    if cofactor_root * cofactor_root == number:
        return square * cofactor_root, squarefree
    return square, squarefree * number


def _smallest_prime_factor(number: int) -> int:
    factor = 2
    while factor * factor <= number:
        if number % factor == 0:
            return factor
        factor += 1
        if factor > 100_000:
            raise Unsupported("a radicand too large to factor")
    return number
