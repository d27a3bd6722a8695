"""A small, bounded LaTeX answer parser for the math verifier's fast path.

``parse_answer`` reads a normalised final answer (see ``verifier.normalize_answer``)
into one of:

- ``("expr", node)``: a scalar expression: numbers, ``+ - * /``, ``\\cdot``, ``\\times``,
  ``\\div``, implicit products (``2x``, ``3(x+1)``, ``2\\sqrt{3}``), powers (``x^2``,
  ``2^{-3}``, ``x^23`` is ``x^2 * 3`` as in LaTeX), ``\\frac{a}{b}`` (also ``\\frac12``),
  ``\\sqrt{..}``, ``\\sqrt[n]{..}``, ``\\binom``, ``n!``, ``\\pi``, single-letter and Greek
  variables with subscripts; an integer right before a ``\\frac`` of integers is a mixed
  number (``2\\frac{1}{2}`` is 5/2);
- ``("seq", open, close, items)``: brackets with commas: tuples and intervals, order and
  bracket shape matter; items may be ``("inf", +1 | -1)``;
- ``("set", items)``: ``\\{...\\}`` or a bare comma list, order-free;
- ``("union", seqs)``: intervals joined by ``\\cup``.

A node is a tuple: ``("num", Fraction, written_as_decimal)``, ``("var", name)``,
``(op, left, right)`` for ``add sub mul div pow``, ``("neg", a)``, ``("root", a, degree)``,
``("fact", a)``, ``("binom", n, k)``. ``evaluate`` computes a node exactly (``exact``)
with variables, ``\\pi`` and ``e`` replaced by the rationals in ``env``.

Anything else (functions such as ``\\sin`` or ``\\log``, ``\\pm``, inequalities, matrices,
``|x|``, complex numbers, deep nesting) raises ``Unsupported``.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

from honing.rewards.math import exact
from honing.rewards.math.exact import Unsupported, Value

Node = tuple[Any, ...]

MAX_DEPTH = 40

_TOKEN_RE = re.compile(r"\d+(?:\.\d*)?|\.\d+|\\[a-zA-Z]+|\\[{}]|\S")
_GREEK = {
    "alpha", "beta", "gamma", "delta", "epsilon", "varepsilon", "zeta", "eta", "theta",
    "vartheta", "lambda", "mu", "nu", "xi", "rho", "sigma", "tau", "phi", "varphi", "chi",
    "psi", "omega", "Gamma", "Delta", "Theta", "Lambda", "Sigma", "Phi", "Psi", "Omega",
}  # fmt: skip
_OPEN = {"(", "[", "{", "\\{"}
_CLOSE = {")", "]", "}", "\\}"}
_PRODUCT = {"*", "\\cdot", "\\times"}
_QUOTIENT = {"/", "\\div"}


def tokenize(text: str) -> list[str]:
    """Split into numbers, ``\\commands``, ``\\{``/``\\}`` and single characters."""
    tokens = _TOKEN_RE.findall(text)
    depth = 0
    for token in tokens:
        depth += (token in _OPEN) - (token in _CLOSE)
        if depth > MAX_DEPTH:
            raise Unsupported(f"brackets nested deeper than {MAX_DEPTH}")
    return tokens


def parse_answer(text: str) -> tuple[Any, ...]:
    """The structure of an answer (module docstring), or ``Unsupported``."""
    tokens = tokenize(text)
    if not tokens:
        raise Unsupported("empty answer")
    parts = _split_top(tokens, "\\cup")
    if len(parts) > 1:
        return ("union", [_parse_bracketed(part, require_comma=True) for part in parts])
    if tokens[0] == "\\{" and _closes_at_end(tokens):
        return ("set", [_parse_item(part) for part in _split_top(tokens[1:-1], ",")])
    bracketed = tokens[0] in "([" and tokens[-1] in ")]" and _closes_at_end(tokens)
    if bracketed and len(_split_top(tokens[1:-1], ",")) > 1:
        return _parse_bracketed(tokens, require_comma=True)
    items = _split_top(tokens, ",")
    if len(items) > 1:
        return ("set", [_parse_item(item) for item in items])
    return ("expr", _parse_item(tokens))


def _parse_bracketed(tokens: list[str], require_comma: bool) -> tuple[Any, ...]:
    if not (tokens and tokens[0] in "([" and tokens[-1] in ")]" and _closes_at_end(tokens)):
        raise Unsupported("a union of something other than intervals")
    items = _split_top(tokens[1:-1], ",")
    if require_comma and len(items) < 2:
        raise Unsupported("an interval without a comma")
    return ("seq", tokens[0], tokens[-1], [_parse_item(item) for item in items])


def _parse_item(tokens: list[str]) -> Node:
    """One element: ``\\infty`` with a sign, or an expression (``x = 5`` gives ``5``)."""
    if tokens and tokens[-1] == "\\infty" and len(tokens) <= 2:
        signs = {(): 1, ("+",): 1, ("-",): -1}
        if tuple(tokens[:-1]) in signs:
            return ("inf", signs[tuple(tokens[:-1])])
    sides = _split_top(tokens, "=")
    if len(sides) > 1:
        if not all(_is_name(side) for side in sides[:-1]):
            raise Unsupported("an equation whose left side is not a variable")
        tokens = sides[-1]
    return _Parser(tokens).parse()


def _is_name(tokens: list[str]) -> bool:
    """``x``, ``\\theta``, ``x_1``, ``x_{12}``, ``f(x)``: a left side to drop."""
    text = "".join(tokens)
    return (
        re.fullmatch(r"(?:[a-zA-Z]|\\[a-zA-Z]+)(?:_(?:\w|\{\w+\}))?(?:\([a-z]\))?", text)
        is not None
    )


def _closes_at_end(tokens: list[str]) -> bool:
    """Whether the first token's bracket closes at the last token and not before."""
    depth = 0
    for index, token in enumerate(tokens):
        depth += (token in _OPEN) - (token in _CLOSE)
        if depth == 0:
            return index == len(tokens) - 1
    return False


def _split_top(tokens: list[str], separator: str) -> list[list[str]]:
    parts: list[list[str]] = [[]]
    depth = 0
    for token in tokens:
        depth += (token in _OPEN) - (token in _CLOSE)
        if token == separator and depth == 0:
            parts.append([])
        else:
            parts[-1].append(token)
    return parts


class _Parser:
    """Recursive descent over one expression's tokens (grammar in the module docstring)."""

    def __init__(self, tokens: list[str]) -> None:
        self.tokens = tokens
        self.position = 0

    def peek(self) -> str | None:
        return self.tokens[self.position] if self.position < len(self.tokens) else None

    def take(self, expected: str | None = None) -> str:
        token = self.peek()
        if token is None or (expected is not None and token != expected):
            raise Unsupported(f"expected {expected or 'more'} at {token!r}")
        self.position += 1
        return token

    def parse(self) -> Node:
        node = self.expression()
        if self.peek() is not None:
            raise Unsupported(f"unexpected {self.peek()!r}")
        return node

    def expression(self) -> Node:
        node = self.term()
        while self.peek() in ("+", "-"):
            operator = "add" if self.take() == "+" else "sub"
            node = (operator, node, self.term())
        return node

    def term(self) -> Node:
        node = self.signed()
        while True:
            token = self.peek()
            if token in _PRODUCT or token in _QUOTIENT:
                self.take()
                node = ("mul" if token in _PRODUCT else "div", node, self.signed())
            elif token is not None and self._starts_atom(token):
                node = ("mul", node, self.power())
            else:
                return node

    def signed(self) -> Node:
        if self.peek() == "-":
            self.take()
            return ("neg", self.signed())
        if self.peek() == "+":
            self.take()
            return self.signed()
        return self.power()

    def power(self) -> Node:
        base = self.postfix()
        if self.peek() != "^":
            return base
        self.take()
        if self.peek() == "-":
            self.take()
            exponent: Node = ("neg", self.argument())
        else:
            exponent = self.argument()
        if _has_variables(exponent):
            raise Unsupported("a variable in an exponent")
        return ("pow", base, exponent)

    def postfix(self) -> Node:
        node = self.atom()
        while self.peek() == "!":
            self.take()
            node = ("fact", node)
        return node

    def argument(self) -> Node:
        """A LaTeX macro argument: ``{...}`` or a single character (``\\frac12``)."""
        token = self.peek()
        if token == "{":
            self.take()
            node = self.expression()
            self.take("}")
            return node
        if token is not None and token[0].isdigit() and len(token) > 1:
            self.tokens[self.position] = token[1:]  # \frac123 is \frac{1}{2}3
            return ("num", Fraction(int(token[0])), False)
        return self.atom()

    def atom(self) -> Node:
        token = self.take()
        if token[0].isdigit() or token[0] == ".":
            return self._number(token)
        if token in ("(", "{", "["):
            node = self.expression()
            self.take({"(": ")", "{": "}", "[": "]"}[token])
            return node
        if token == "\\frac":
            return ("div", self.argument(), self.argument())
        if token == "\\sqrt":
            return self._root()
        if token == "\\binom":
            return ("binom", self.argument(), self.argument())
        if token == "\\pi" or token[1:] in _GREEK or (len(token) == 1 and token.isalpha()):
            return self._variable(token)
        raise Unsupported(f"cannot read {token!r}")

    def _number(self, token: str) -> Node:
        value = Fraction(token)
        is_decimal = "." in token
        if not is_decimal and self.peek() == "\\frac":  # a mixed number: 2\frac{1}{2}
            saved = self.position
            self.take()
            fraction = ("div", self.argument(), self.argument())
            if all(part[0] == "num" and not part[2] for part in fraction[1:]):
                return ("add", ("num", value, False), fraction)
            self.position = saved
        return ("num", value, is_decimal)

    def _root(self) -> Node:
        degree = 2
        if self.peek() == "[":
            self.take()
            digits = self.take()
            self.take("]")
            if not digits.isdigit() or not 1 <= int(digits) <= 100:
                raise Unsupported("a root degree other than 1..100")
            degree = int(digits)
        return ("root", self.argument(), degree)

    def _variable(self, token: str) -> Node:
        name = token
        if self.peek() == "_":
            self.take()
            subscript = self.argument()
            if subscript[0] not in ("num", "var"):
                raise Unsupported("a compound subscript")
            name += "_" + str(subscript[1])
        return ("var", name)

    @staticmethod
    def _starts_atom(token: str) -> bool:
        return (
            token[0].isdigit()
            or token in ("(", "{", "\\frac", "\\sqrt", "\\binom", "\\pi")
            or token[1:] in _GREEK
            or (len(token) == 1 and token.isalpha())
        )


def _has_variables(node: Node) -> bool:
    if node[0] == "var":
        return True
    return any(isinstance(child, tuple) and _has_variables(child) for child in node[1:])


def variables(structure: Any) -> set[str]:
    """Names of the variables (``\\pi`` and ``e`` included) anywhere in a parsed answer."""
    if isinstance(structure, list):
        return set().union(*(variables(item) for item in structure)) if structure else set()
    if not isinstance(structure, tuple):
        return set()
    if structure[0] == "var":
        return {structure[1]}
    return set().union(*(variables(child) for child in structure[1:]))


def has_decimal(node: Node) -> bool:
    """Whether a number in the expression was written with a decimal point."""
    if node[0] == "num":
        return node[2]
    return any(isinstance(child, tuple) and has_decimal(child) for child in node[1:])


def evaluate(node: Node, env: dict[str, Fraction]) -> Value:
    """The exact value of ``node`` with each variable set from ``env``.

    Raises:
        Unsupported: beyond the fast path's limits (``exact``).
        ZeroDivisionError: a zero denominator at this point.
        KeyError: a variable missing from ``env``.
    """
    kind = node[0]
    if kind == "num":
        return exact.constant(node[1])
    if kind == "var":
        return exact.constant(env[node[1]])
    if kind == "neg":
        return exact.negate(evaluate(node[1], env))
    if kind == "root":
        return exact.root(evaluate(node[1], env), node[2])
    if kind == "fact":
        return exact.factorial(evaluate(node[1], env))
    if kind == "inf":
        raise Unsupported("infinity outside an interval")
    left, right = evaluate(node[1], env), evaluate(node[2], env)
    if kind == "add":
        return exact.add(left, right)
    if kind == "sub":
        return exact.add(left, exact.negate(right))
    if kind == "mul":
        return exact.multiply(left, right)
    if kind == "div":
        return exact.multiply(left, exact.inverse(right))
    if kind == "pow":
        exponent = exact.as_rational(right)
        if exponent is None:
            raise Unsupported("an irrational exponent")
        return exact.power(left, exponent)
    if kind == "binom":
        return _binomial(left, right)
    raise Unsupported(f"unknown node {kind!r}")


def _binomial(total: Value, chosen: Value) -> Value:
    n, k = exact.as_rational(total), exact.as_rational(chosen)
    if n is None or k is None or n.denominator != 1 or k.denominator != 1 or not 0 <= n <= 1000:
        raise Unsupported("a binomial other than integers 0..1000")
    if not 0 <= k <= n:
        return exact.constant(0)
    numerator = exact.factorial(total)[1]
    denominator = exact.factorial(chosen)[1] * exact.factorial(exact.constant(n - k))[1]
    return exact.constant(numerator / denominator)
