"""The calculator tool (rollout/tools/calculator.py): exact values, decimal literals read
from their text, big integers written in full, and every failure a ``CalculatorError``."""

import contextlib
import random
import subprocess
import sys
from pathlib import Path

import pytest

from honing.rollout.tools.calculator import CALC_MAX_BITS, CalculatorError, calculate
from honing.rollout.tools.calls import ToolCall, run_calls
from honing.rollout.tools.specs import build_tools

TOOLS = build_tools(["calculator"])
ROOT = Path(__file__).resolve().parents[2]


def test_calculator_is_exact_on_eight_digit_sums_and_products():
    rng = random.Random(0)
    for _ in range(200):
        a, b = rng.randrange(10**7, 10**8), rng.randrange(10**7, 10**8)
        assert calculate(f"{a} + {b}") == str(a + b)
        assert calculate(f"{a} * {b}") == str(a * b)
        assert calculate(f"({a} - {b}) * {a} // 7 % 1000") == str((a - b) * a // 7 % 1000)
    assert calculate("99999999 ** 20") == str(99999999**20)


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("0.1 + 0.2", "0.3"),
        ("7 / 8", "0.875"),
        ("-1 / 4", "-0.25"),
        ("2 ** -3", "0.125"),
        ("1 / 3", "0.33333333333333333333 (= 1/3)"),
        ("1 ** (10 ** 10)", "1"),
        ("-(3)", "-3"),
        # Decimal literals are their text's exact value, never a float's.
        ("1e309", "1" + "0" * 309),
        ("-1e309 + 1", "-" + "9" * 309),
        ("1e-400", "0." + "0" * 399 + "1"),
        ("1e-400 * 1e400", "1"),
        ("0." + "3" * 1998, "0." + "3" * 1998),
        ("1." + "0" * 30 + "1", "1." + "0" * 30 + "1"),
        ("1_000.5e-1", "100.05"),
        ("2.5E+3 + .5 + 1.", "2501.5"),
        ("0e99999", "0"),
        ("1000e-3", "1"),
    ],
)
def test_calculator_values(expression, value):
    assert calculate(expression) == value


def test_values_at_the_bit_bound_are_written_in_full():
    """2**16383 has 4,932 digits, past Python's default 4,300-digit int-to-string limit,
    inside CALC_MAX_BITS; it is written exactly, as an integer, a terminating decimal and
    the fraction beside an inexact quotient. The digits are checked in pieces small enough
    for ``str``."""
    big = 2**16383
    head, tail = str(big // 10**4912), str(big % 10**20).zfill(20)
    whole = calculate("2**16383")
    assert len(whole) == 4932 and whole.startswith(head) and whole.endswith(tail)
    assert calculate("-(2**16383)") == "-" + whole
    assert calculate("2**16383 / 10") == whole[:-1] + "." + whole[-1]
    third = calculate("2**16383 / 3")
    assert third.endswith(f"(= {whole}/3)") and third.startswith("1.9828858255953862751E+4931 ")


def test_big_values_do_not_depend_on_the_process_digit_limit():
    """Under the lowest int-to-string limit a process can set (640 digits) a 4,932-digit
    result is still written in full."""
    code = (
        "from honing.rollout.tools.calculator import calculate\n"
        "print(len(calculate('2**16383')), calculate('1e700 + 1')[-3:])"
    )
    done = subprocess.run(
        [sys.executable, "-X", "int_max_str_digits=640", "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["4932", "001"]


@pytest.mark.parametrize(
    ("expression", "reason"),
    [
        ("x + 1", "names are not allowed"),
        ("__import__('os').system('true')", "function calls are not allowed"),
        ("(1).real", "attribute access is not allowed"),
        ("10**10**10", "result too large"),
        ("(10**4000) * (10**4000)", "result too large"),
        ("2 ** 16384", "result too large"),
        ("2 ** 0.5", "the exponent must be an integer"),
        ("1 / 0", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("1 // 0.0", "division by zero"),
        ("'a' * 3", "unsupported literal"),
        ("1j", "unsupported literal"),
        ("[1][0]", "subscripts are not allowed"),
        ("[1, 2]", "unsupported syntax: List"),
        ("1 +", "invalid syntax"),
        ("(" * 5000 + "1" + ")" * 5000, "longer than"),
        # A literal past the bit bound is refused before its value is computed.
        ("1e99999", f"needs over {CALC_MAX_BITS} bits"),
        ("1e-99999", f"needs over {CALC_MAX_BITS} bits"),
        ("1e5000", "result too large"),
        ("1e" + "9" * 40, "out of range"),
    ],
)
def test_calculator_refuses(expression, reason):
    with pytest.raises(CalculatorError, match=reason.replace("(", r"\(")):
        calculate(expression)


def test_any_expression_is_a_value_or_a_calculator_error():
    """Random strings over the calculator's alphabet: each gives a value or a refusal, never
    another exception."""
    rng = random.Random(1)
    alphabet = ["1", "9", "0", ".", "e", "e-", "_", "+", "-", "*", "/", "//", "%", "**", "(", ")"]
    alphabet += ["99999", "1e400", "1e-400", " "]
    for _ in range(3000):
        expression = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 16)))
        with contextlib.suppress(CalculatorError):
            assert isinstance(calculate(expression), str)


def test_calculator_tool_returns_refusals_as_error_text():
    calls = [ToolCall("calculator", {"expression": e}) for e in ("10**10**10", "1e99999")]
    too_large, literal = run_calls(calls, TOOLS, 5.0, 100)
    assert too_large.error and too_large.output.startswith("error: result too large")
    assert literal.error and literal.output == "error: literal '1e99999' needs over 16384 bits"
