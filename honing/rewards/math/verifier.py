"""Math answer verification: extract the final answer, normalise it, decide equivalence.

``extract_answer`` takes, in order: the last ``\\boxed{..}`` / ``\\fbox{..}`` (nested braces),
the last ``#### ..`` line, the text after the last "final answer" / "the answer is", a short
one-line response that is itself an answer, and (``last_number_fallback``) the last number,
all in what follows the last tool response (``</tool_response>``: a multi-turn response's
tool output is in its text, and the answer is the model's, as ``numeric`` reads it).
``normalize_answer`` removes what a grader ignores: ``$`` delimiters, ``\\left``/``\\right``,
spacing macros, ``\\dfrac``/``\\tfrac`` (read as ``\\frac``), ``\\text{..}`` wrappers, units
after a number (``\\text{ cm}``, ``5 dollars``, ``90^\\circ``, ``\\$``), thousands separators,
a trailing full stop; ``x = 5`` becomes ``5`` in the parser.

The fast path (``equivalence.fast_check``, with its grading rules) compares exactly,
in process, with no sympy. What it cannot read or bound goes to the slow path: math-verify in
a killable worker process (``pool``), on the extracted, normalised answer.
"""

from __future__ import annotations

import re
import threading
from decimal import Decimal
from typing import Any

from honing.rewards.math import expr as math_expr
from honing.rewards.math.equivalence import fast_check
from honing.rewards.math.exact import Unsupported
from honing.rewards.math.numeric import TOOL_RESPONSE_END
from honing.rewards.math.pool import Job, MathPool

MAX_REPORTED_CHARS = 200  # of the extracted answer in a result (results travel over HTTP)

_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*(\{|[^\s{])")
_HASHES_RE = re.compile(r"####[ \t]*([^\n]+)")
_ANSWER_IS_RE = re.compile(
    r"(?:final answer(?:\s+is)?|the answer\s+is|answer\s*[:=])\s*[:=]?\s*", re.IGNORECASE
)
_NUMBER_RE = re.compile(r"(?<![\w)\]])-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?(?:/\d+)?")
_SENTENCE_END_RE = re.compile(r"\.(?:\s|$)|\n")
_SPACING_RE = re.compile(
    r"\\(?:left|right|big|Big|bigg|Bigg)(?![a-zA-Z])\.?|(?<!\\)\\[!,;:> ]|~|\\q?quad|\\displaystyle"
)
_TEXT_RE = re.compile(r"\\(?:text|textbf|textrm|textit|mbox|mathbf|mathrm)\s*\{([^{}]*)\}")
_UNIT_TEXT_RE = re.compile(
    r"(?<=[\d}.)])\s*\\(?:text|mbox|mathrm)\s*\{\s*[a-zA-Z .]*\}(?:\^\{?[23]\}?)?$"
)
_DEGREES_RE = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|\\circ|\\degree|°")
_THOUSANDS_RE = re.compile(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_SPACED_THOUSANDS_RE = re.compile(r"(?<=\d) (?=\d{3}(?!\d))")
_NUMBER_WITH_WORDS_RE = re.compile(
    r"([-+]?(?:\d+(?:\.\d+)?|\.\d+)(?:/\d+)?|[-+]?\\frac\{\d+\}\{\d+\})"
    r"\s+[a-zA-Z]{2,}(?:[\s-]+[a-zA-Z]+)*(?:\^\{?[23]\}?)?"
)
_UNICODE = {"π": "\\pi", "×": "\\times", "·": "\\cdot", "−": "-", "√": "\\sqrt", "∞": "\\infty",
            "≤": "\\le", "≥": "\\ge", "÷": "\\div", "∪": "\\cup"}  # fmt: skip


def extract_answer(text: str, *, last_number_fallback: bool = True) -> str | None:
    """The final answer in ``text`` as written, or ``None`` (order in the module docstring)."""
    text = text.rpartition(TOOL_RESPONSE_END)[2]
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    hashes = _HASHES_RE.findall(text)
    if hashes:
        return hashes[-1].strip()
    stated = list(_ANSWER_IS_RE.finditer(text))
    if stated:
        answer = _answer_after(text[stated[-1].end() :])
        numbers = _NUMBER_RE.findall(answer)
        if answer and not _parses(answer) and len(numbers) == 1:
            return numbers[0]  # "the answer is that there are 5 ways": 5
        if answer:
            return answer
    if not last_number_fallback:
        return None
    stripped = text.strip()
    if 0 < len(stripped) <= 80 and "\n" not in stripped and _parses(stripped):
        return stripped
    numbers = _NUMBER_RE.findall(text)
    return numbers[-1] if numbers else None


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{..}`` whose braces close (or ``\\boxed 5``)."""
    for match in list(_BOXED_RE.finditer(text))[::-1][:20]:  # bounded on unclosed boxes
        if match.group(1) != "{":
            return re.match(r"[^\s$]+", text[match.start(1) :]).group(0)  # type: ignore[union-attr]
        depth = 1
        for index in range(match.end(), len(text)):
            depth += {"{": 1, "}": -1}.get(text[index], 0)
            if depth == 0:
                return text[match.end() : index].strip()
    return None


def _answer_after(tail: str) -> str:
    """The answer stated at the start of ``tail``: a ``$..$`` span, else up to the sentence end."""
    tail = tail.lstrip("* ")
    for opening, closing in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if tail.startswith(opening):
            end = tail.find(closing, len(opening))
            if end > 0:
                return tail[len(opening) : end].strip()
    end = _SENTENCE_END_RE.search(tail)
    return tail[: end.start() if end else len(tail)].strip(" *")


def _parses(text: str) -> bool:
    """Whether ``text`` reads as a math answer with no words in it (for whole responses)."""
    if re.search(r"(?<![\\a-zA-Z])[a-zA-Z]{2,}", text):
        return False
    try:
        math_expr.parse_answer(normalize_answer(text))
    except (Unsupported, ValueError, ZeroDivisionError):
        return False
    return True


def normalize_answer(text: str) -> str:
    """The answer with what a grader ignores removed (module docstring); idempotent."""
    for symbol, latex in _UNICODE.items():
        text = text.replace(symbol, latex)
    text = text.strip().strip("$")
    if text.startswith(("\\(", "\\[")) and text.endswith(("\\)", "\\]")):
        text = text[2:-2]
    text = _SPACING_RE.sub(" ", text).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    text = text.replace("{,}", "").replace("\\$", "").replace("$", "")
    text = _DEGREES_RE.sub("", text).replace("\\%", "").replace("%", "")
    text = _UNIT_TEXT_RE.sub("", text.strip())
    previous = None
    while previous != text:
        previous, text = text, _TEXT_RE.sub(r"\1", text)
    text = re.sub(r"\s+", " ", text).strip().rstrip(".").strip()
    text = re.sub(r"\s*(percent|per cent)$", "", text)
    with_words = _NUMBER_WITH_WORDS_RE.fullmatch(text)
    if with_words:
        text = with_words.group(1)
    text = _SPACED_THOUSANDS_RE.sub("", text)
    if _THOUSANDS_RE.fullmatch(text):
        text = text.replace(",", "")
    return text


def _truth_text(ground_truth: Any) -> str:
    """A ground truth as answer text: floats in plain notation, boxed or ``$`` stripped."""
    if isinstance(ground_truth, float):
        return format(Decimal(repr(ground_truth)), "f")
    text = str(ground_truth)
    boxed = _last_boxed(text)
    return boxed if boxed is not None else text


def _result(score: float, verdict: str, reason: str, extracted: str | None, path: str) -> dict:
    if extracted is not None and len(extracted) > MAX_REPORTED_CHARS:
        extracted = extracted[:MAX_REPORTED_CHARS] + "..."
    if len(reason) > 2 * MAX_REPORTED_CHARS:
        reason = reason[: 2 * MAX_REPORTED_CHARS] + "..."
    return {
        "score": score,
        "verdict": verdict,
        "reason": reason,
        "extracted": extracted,
        "path": path,
    }


def _fast(
    response: str, ground_truth: Any, last_number_fallback: bool
) -> tuple[dict[str, Any], Job | None]:
    """The fast path's result, and the slow-path job when it cannot decide (else ``None``)."""
    truths = list(ground_truth) if isinstance(ground_truth, (list, tuple)) else [ground_truth]
    truth_texts = [normalize_answer(_truth_text(truth)) for truth in truths]
    extracted = extract_answer(str(response), last_number_fallback=last_number_fallback)
    answer = normalize_answer(extracted) if extracted is not None else ""
    if not answer:
        return _result(0.0, "no_answer", "no final answer found", extracted, "fast"), None
    undecided = []
    for truth in truth_texts:
        decision = fast_check(answer, truth)
        if decision:
            return _result(1.0, "correct", f"equals {truth!r}", extracted, "fast"), None
        if decision is None:
            undecided.append(f"${truth}$")
    if not undecided:
        reason = f"{answer!r} differs from {' / '.join(map(repr, truth_texts))}"
        return _result(0.0, "wrong", reason, extracted, "fast"), None
    pending = _result(0.0, "unparsable", "beyond the fast path", extracted, "fast")
    return pending, (undecided, f"${answer}$")


def _merge_slow(fast: dict[str, Any], slow: dict[str, Any]) -> dict[str, Any]:
    score = 1.0 if slow["verdict"] == "correct" else 0.0
    return _result(score, slow["verdict"], slow["reason"], fast["extracted"], "slow")


_default_pool: MathPool | None = None
_default_pool_lock = threading.Lock()


def _shared_pool() -> MathPool:
    """The process-wide pool behind ``verify_math`` / ``math_reward``, created on first use."""
    global _default_pool
    with _default_pool_lock:
        if _default_pool is None:
            _default_pool = MathPool()
        return _default_pool


def verify_math(
    response: str,
    ground_truth: Any,
    *,
    last_number_fallback: bool = True,
    slow_path: bool = True,
) -> dict[str, Any]:
    """Score one response against a ground truth (a str, int, float, or a list of any-of).

    The fast path decides in process; what it cannot decide goes to math-verify in the
    shared worker pool (5 s deadline) when ``slow_path``, else gets verdict ``"unparsable"``.

    Returns:
        ``{"score": 1.0 | 0.0, "verdict": "correct" | "wrong" | "no_answer" | "unparsable" |
        "timeout", "reason": str, "extracted": str | None, "path": "fast" | "slow"}``.
    """
    result, job = _fast(response, ground_truth, last_number_fallback)
    if job is None or not slow_path:
        return result
    return _merge_slow(result, _shared_pool().check([job])[0])


def math_reward(response: str, ground_truth: Any, **context: Any) -> dict[str, Any]:
    """The registry's ``math`` reward: ``verify_math`` with the shared pool; context ignored."""
    return verify_math(response, ground_truth)


class MathVerifier:
    """Batch math scoring: fast path in process, the rest in a pool of worker processes.

    Args:
        workers: math-verify worker processes (default ``os.cpu_count()``), started on the
            first batch that needs one.
        timeout_s: each slow check's deadline (verdict ``"timeout"``, score 0, past it).
        last_number_fallback: take the last number when no answer is marked.
        memory_limit_mb: address-space cap of each worker.
    """

    def __init__(
        self,
        workers: int | None = None,
        timeout_s: float = 5.0,
        last_number_fallback: bool = True,
        memory_limit_mb: int | None = 4096,
    ) -> None:
        self.last_number_fallback = last_number_fallback
        self.pool = MathPool(workers, timeout_s=timeout_s, memory_limit_mb=memory_limit_mb)

    def __call__(self, response: str, ground_truth: Any, **context: Any) -> dict[str, Any]:
        return self.score_batch([{"response": response, "ground_truth": ground_truth}])[0]

    def score_batch(self, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Results in item order; a malformed item gets verdict ``"unparsable"``, not an error."""
        results: list[dict[str, Any]] = []
        slow: list[tuple[int, Job]] = []
        for index, item in enumerate(items):
            try:
                result, job = _fast(
                    item["response"], item["ground_truth"], self.last_number_fallback
                )
            except Exception as exc:  # noqa: BLE001 - one bad item must not fail the batch
                result, job = _result(0.0, "unparsable", _describe(exc), None, "fast"), None
            results.append(result)
            if job is not None:
                slow.append((index, job))
        checked = self.pool.check([job for _, job in slow]) if slow else []
        for (index, _), outcome in zip(slow, checked, strict=True):
            results[index] = _merge_slow(results[index], outcome)
        return results

    def close(self) -> None:
        self.pool.close()

    def __enter__(self) -> MathVerifier:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _describe(exc: BaseException) -> str:
    message = " ".join(str(exc).split())
    return f"verifier error: {type(exc).__name__}: {message}"
