"""The built-in ``calculator`` tool's arithmetic: an expression evaluated exactly.

An ``expression`` (integers and decimal literals, ``+ - * / // % **``, parentheses) is
parsed by ``ast`` and walked node by node, never ``eval``: names, attribute access, calls and
subscripts are refused. Values are ``Fraction``s, so big integers and decimals stay exact:
a decimal literal is read from its text in the expression, never through a float, so
``0.1`` is 1/10, ``1e-400`` is 10**-400 and ``1e309`` is 10**309. An exponent must be an
integer and every value, literals included, is kept under ``CALC_MAX_BITS`` bits, checked
before it is computed where it could be large (``10**10**10``, ``1e99999``).

The result is an integer's every digit, or a decimal: exact when it terminates, else to
``CALC_DIGITS`` significant digits with the exact fraction beside it. Digits are written by
``decimal`` (exact, and not bound by Python's limit on int-to-string conversion,
``sys.set_int_max_str_digits``), so a 4,932-digit ``2**16383`` is written in full.

Every failure is a ``CalculatorError`` whose message is for the model.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from decimal import Context, Decimal, InvalidOperation
from fractions import Fraction

CALC_MAX_CHARS = 2000
"""Characters of an expression."""
CALC_MAX_BITS = 1 << 14  # ~4,900 decimal digits
"""Bits of any value: numerator and denominator of every literal and intermediate result."""
CALC_DIGITS = 20
"""Significant digits of a result that is not a terminating decimal."""

_BINARY: dict[type, Callable[[Fraction, Fraction], Fraction]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_REFUSED = {
    ast.Name: "names are not allowed",
    ast.Attribute: "attribute access is not allowed",
    ast.Call: "function calls are not allowed",
    ast.Subscript: "subscripts are not allowed",
}
_TOO_LARGE = f"result too large (over {CALC_MAX_BITS} bits)"


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate; the message is for the model."""


def calculate(expression: str) -> str:
    """The exact value of ``expression``, as text (module docstring).

    Raises:
        CalculatorError: a refused construct, a too large value, a division by zero, a
            syntax error; any failure of the evaluation.
    """
    if len(expression) > CALC_MAX_CHARS:
        raise CalculatorError(f"expression longer than {CALC_MAX_CHARS} characters")
    source = expression.strip()
    try:
        tree = ast.parse(source, mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"invalid syntax: {exc.msg}") from None
    except (RecursionError, MemoryError, ValueError):
        raise CalculatorError("expression too deeply nested or malformed") from None
    try:
        return _format(_evaluate(tree.body, source))
    except CalculatorError:
        raise
    except ZeroDivisionError:
        raise CalculatorError("division by zero") from None
    except RecursionError:
        raise CalculatorError("expression too deeply nested") from None
    except (ArithmeticError, ValueError, TypeError, MemoryError) as exc:
        raise CalculatorError(f"cannot evaluate ({type(exc).__name__})") from None


def _evaluate(node: ast.AST, source: str) -> Fraction:
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, float):
            return _decimal_literal(ast.get_source_segment(source, node) or "")
        if isinstance(value, bool) or not isinstance(value, int):
            raise CalculatorError(f"unsupported literal {value!r}; expected a number")
        return _checked(Fraction(value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        operand = _evaluate(node.operand, source)
        return -operand if isinstance(node.op, ast.USub) else operand
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        return _checked(_power(_evaluate(node.left, source), _evaluate(node.right, source)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left, source), _evaluate(node.right, source)
        return _checked(_BINARY[type(node.op)](left, right))
    for kind, reason in _REFUSED.items():
        if isinstance(node, kind):
            raise CalculatorError(reason)
    raise CalculatorError(f"unsupported syntax: {type(node).__name__}")


def _decimal_literal(text: str) -> Fraction:
    """The exact value of a float literal's ``text`` (``1.5``, ``1e-400``, ``1_000.25``),
    refused before it is computed when its exponent puts it past ``CALC_MAX_BITS``."""
    try:
        value = Decimal(text)
    except InvalidOperation:  # an exponent past decimal's own range
        raise CalculatorError(f"literal {text[:40]!r} out of range") from None
    if not value.is_finite():
        raise CalculatorError(f"unsupported literal {text[:40]!r}; expected a number")
    if value.is_zero():
        return Fraction(0)
    # Digits cancel at most CALC_MAX_CHARS powers of ten of a negative exponent (1000e-3).
    if abs(value.as_tuple().exponent) > CALC_MAX_BITS + CALC_MAX_CHARS:
        raise CalculatorError(f"literal {text[:40]!r} needs over {CALC_MAX_BITS} bits")
    return _checked(Fraction(value))


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    """``base ** exponent`` for an integer exponent, refused before it grows past CALC_MAX_BITS."""
    if exponent.denominator != 1:
        raise CalculatorError("the exponent must be an integer")
    if base in (0, 1) or exponent in (0, 1):
        return base**exponent
    if base == -1:
        return Fraction(-1 if exponent.numerator % 2 else 1)
    size = max(base.numerator.bit_length(), base.denominator.bit_length())
    if (size - 1) * abs(exponent.numerator) > CALC_MAX_BITS:
        raise CalculatorError(_TOO_LARGE)
    return base**exponent.numerator


def _checked(value: Fraction) -> Fraction:
    if max(value.numerator.bit_length(), value.denominator.bit_length()) > CALC_MAX_BITS:
        raise CalculatorError(_TOO_LARGE)
    return value


def _digits(value: int) -> str:
    """``str(value)`` for any size: ``decimal`` converts without Python's digit limit."""
    return str(Decimal(value))


def _format(value: Fraction) -> str:
    if value.denominator == 1:
        return _digits(value.numerator)
    denominator, twos, fives = value.denominator, 0, 0
    while denominator % 2 == 0:
        denominator, twos = denominator // 2, twos + 1
    while denominator % 5 == 0:
        denominator, fives = denominator // 5, fives + 1
    if denominator == 1:  # a terminating decimal: exact with max(twos, fives) places
        places = max(twos, fives)
        scaled = value.numerator * 10**places // value.denominator
        sign, digits = "-" * (scaled < 0), _digits(abs(scaled)).rjust(places + 1, "0")
        return f"{sign}{digits[:-places]}.{digits[-places:]}"
    context = Context(prec=CALC_DIGITS)
    approx = context.divide(Decimal(value.numerator), Decimal(value.denominator))
    return f"{approx} (= {_digits(value.numerator)}/{_digits(value.denominator)})"
