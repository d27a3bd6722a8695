"""Score a Python program against tests, in the sandbox, with a harness the program cannot fool.

Ground truth (a dict, or the same as a JSON string as verl datasets store it):

- stdin/stdout cases: ``{"tests": [{"stdin": "1 2\\n", "stdout": "3\\n"}, ...]}`` (also
  ``{"inputs": [...], "outputs": [...]}``). Each case is one sandboxed run; the parent compares
  the output, whitespace-normalised per line (runs of spaces collapsed, trailing whitespace and
  trailing blank lines ignored). Only the output matters: printing the answer is the answer.
- assert-based: ``{"test_code": ..., "entry_point": ...}``. With a ``check`` function in
  ``test_code`` (HumanEval), ``check(<entry_point>)`` is one test; otherwise every top-level
  ``assert`` is one test and other statements are setup (MBPP; ``test_list`` is accepted too).

Scoring: ``"all"`` (1.0 only if every test passes) or ``"pass_rate"`` (fraction passed).

Where programs run: each worker keeps a zygote, a Python already started inside its sandbox
(``zygote``: what consecutive programs of a worker share and why that is safe); every program
(every stdin/stdout case) is a fresh fork of it, with its own directory, limits and deadline.

Why assert-based tests cannot be fooled: the program never shares a process with the tests.
In its run the judge (``_judge.py``) is non-dumpable (so a process without ``CAP_SYS_PTRACE``
cannot read its memory or file descriptors), reads the program, forks the candidate process,
which closes every descriptor but its two RPC pipes *before* running the program, and
only then reads the tests and a per-run secret nonce. The tests run in the judge; every name the
program defines becomes a proxy that calls into the candidate process, and results come back
through ``marshal``, which can only carry exact builtin data (None, bool, int, float, complex,
str, bytes, tuple, list, dict, set, frozenset, checked again on arrival). So no ``__eq__``
override, patched builtin, patched module, ``AssertionError`` or ``unittest`` redefinition
reaches the tests; ``sys.exit``/``os._exit``/atexit in the program end only the candidate
process (then the call fails); printing a "passed" marker goes to /dev/null. The verdict is the
judge's nonce-marked lines on a side-channel pipe the candidate has closed; exit codes prove
nothing. Limits: the program's functions must take and return builtin data (objects of its
own classes, generators, in-place mutation of arguments do not cross the process boundary, so
such tests fail); ``check`` is one test, so ``pass_rate`` is 0 or 1 for HumanEval; on backend
``none`` as a non-root user the candidate runs as the same uid as the judge, the zygote and
the host, so it could signal them (see ``sandbox`` and ``zygote``).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from honing.sandbox.isolation import Limits, SandboxResult, resolve_backend
from honing.sandbox.zygote import ZygotePool

SCORINGS = ("all", "pass_rate")
_FENCE = re.compile(r"```[ \t]*([\w+#-]*)[^\n]*\n(.*?)```", re.DOTALL)
_PYTHON_TAGS = ("python", "py", "python3")
_SHARED_POOLS: dict[str, ZygotePool] = {}
_SHARED_LOCK = threading.Lock()


def _shared_pool(backend: str) -> ZygotePool:
    """The zygotes ``verify_code`` uses (one pool per backend, ``os.cpu_count()`` workers)."""
    with _SHARED_LOCK:
        if backend not in _SHARED_POOLS:
            _SHARED_POOLS[backend] = ZygotePool(backend)
        return _SHARED_POOLS[backend]


def extract_program(response: str) -> tuple[str, str | None]:
    """The program in ``response`` and its fence language (None: unfenced or untagged).

    The last ```python (or ```py) block wins; else the last untagged block; else the last
    block in another language (its tag is returned so the caller can reject it); else the
    whole response.
    """
    blocks = [(match.group(1).lower(), match.group(2)) for match in _FENCE.finditer(response)]
    for wanted in (_PYTHON_TAGS, ("",)):
        chosen = [code for tag, code in blocks if tag in wanted]
        if chosen:
            return chosen[-1], None
    if blocks:
        return blocks[-1][1], blocks[-1][0]
    return response, None


def _result(verdict: str, reason: str, passed: int, total: int, score: float, isolation: str):
    return {
        "score": float(score),
        "verdict": verdict,
        "reason": " ".join(reason.split())[:300],
        "passed": passed,
        "total": total,
        "isolation": isolation,
    }


def _normalise(output: str) -> list[str]:
    lines = [" ".join(line.split()) for line in output.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _parse_ground_truth(ground_truth: Any) -> dict:
    """The ground truth as a dict with ``tests`` or ``test_code``.

    Raises:
        ValueError: not a dict / JSON object, or neither form of tests is present.
    """
    if isinstance(ground_truth, str | bytes):
        ground_truth = json.loads(ground_truth)
    if not isinstance(ground_truth, dict):
        raise ValueError(f"ground truth is a {type(ground_truth).__name__}, expected a dict")
    truth = dict(ground_truth)
    if "inputs" in truth and "outputs" in truth and "tests" not in truth:
        pairs = zip(truth["inputs"], truth["outputs"], strict=True)
        truth["tests"] = [{"stdin": i, "stdout": o} for i, o in pairs]
    if "test_list" in truth and "test_code" not in truth:
        setup = truth.get("test_setup_code") or ""
        truth["test_code"] = "\n".join([setup, *truth["test_list"]])
    if not truth.get("tests") and not truth.get("test_code"):
        raise ValueError("ground truth has neither 'tests' (stdin/stdout) nor 'test_code'")
    entry = truth.get("entry_point")
    if entry is not None and not str(entry).isidentifier():
        raise ValueError(f"entry_point {entry!r} is not a Python identifier")
    return truth


def _score(passed: int, total: int, scoring: str) -> float:
    if total == 0:
        return 0.0
    return passed / total if scoring == "pass_rate" else float(passed == total)


def _run_stdio(program: str, tests: list, scoring: str, limits: Limits, pool: ZygotePool) -> dict:
    """One sandboxed run per case; with scoring "all", stop at the first failure."""
    passed, isolation, verdict, reason = 0, pool.backend, "passed", "all tests passed"
    for index, case in enumerate(tests):
        stdin = _frame({"program": program}) + str(case.get("stdin", "")).encode()
        run = pool.run("main", stdin, limits)
        isolation = run.isolation
        if run.timed_out:
            verdict, reason = "timeout", f"case {index} ran past {limits.timeout_s:g}s"
        elif run.returncode != 0:
            verdict, reason = "failed", f"case {index} exited {run.signal or run.returncode}"
        elif _normalise(run.stdout) != _normalise(str(case.get("stdout", ""))):
            verdict, reason = "failed", f"case {index}: wrong output"
        else:
            passed += 1
            continue
        if scoring == "all":
            break
    if passed < len(tests) and verdict == "passed":
        verdict = "failed"
    return _result(
        verdict, reason, passed, len(tests), _score(passed, len(tests), scoring), isolation
    )


def _frame(payload: dict) -> bytes:
    data = json.dumps(payload).encode()
    return struct.pack(">I", len(data)) + data


def _run_asserts(program: str, truth: dict, scoring: str, limits: Limits, pool: ZygotePool) -> dict:
    """All tests of the program in one sandbox: judge process + candidate process."""
    nonce = secrets.token_hex(16)
    spec = {
        "test_code": truth["test_code"],
        "entry_point": truth.get("entry_point"),
        "nonce": nonce,
    }
    run = pool.run("judge", _frame({"program": program}) + _frame(spec), limits)
    return _judge_verdict(run, nonce, scoring, limits)


def _judge_verdict(run: SandboxResult, nonce: str, scoring: str, limits: Limits) -> dict:
    """Read the judge's nonce-marked lines; anything else on the channel is ignored."""
    total, outcomes, done, problem = None, [], False, ""
    for line in run.channel.decode("utf-8", errors="replace").splitlines():
        marker, _, message = line.partition(" ")
        if marker != nonce:
            continue
        word, _, detail = message.partition(" ")
        if word == "total" and total is None:
            total = int(detail)
        elif word in ("pass", "fail"):
            outcomes.append(word == "pass")
            if word == "fail" and not problem:
                problem = f"test {len(outcomes) - 1} failed: {detail}"
        elif word in ("load", "setup") and not problem:
            problem = f"program failed to load: {detail}" if word == "load" else detail
        elif word == "done":
            done = True
    total = total or 0
    passed = sum(outcomes)
    score = _score(passed, total, scoring)
    if run.timed_out:
        return _result(
            "timeout",
            f"ran past {limits.timeout_s:g}s",
            passed,
            total,
            score if scoring == "pass_rate" else 0.0,
            run.isolation,
        )
    if not done:
        reason = problem or f"the test harness did not finish ({run.signal or run.returncode})"
        return _result(
            "failed", reason, passed, total, score if scoring == "pass_rate" else 0.0, run.isolation
        )
    if total and passed == total:
        return _result(
            "passed", f"{passed}/{total} tests passed", passed, total, score, run.isolation
        )
    return _result("failed", problem or "no tests ran", passed, total, score, run.isolation)


def verify_code(
    response: str,
    ground_truth: Any,
    *,
    scoring: str = "all",
    limits: Limits | None = None,
    backend: str = "auto",
) -> dict:
    """Score the program in ``response`` against ``ground_truth`` (forms in the module doc).

    Returns ``{"score", "verdict", "reason", "passed", "total", "isolation"}``; verdict is
    passed | failed | no_code | timeout | error. Never raises for a bad response or ground
    truth (verdict "error"); raises ValueError for an unknown ``scoring`` or ``backend``.
    """
    if scoring not in SCORINGS:
        raise ValueError(f"unknown scoring {scoring!r}; expected one of {SCORINGS}")
    return _verify(
        response, ground_truth, scoring, limits or Limits(), _shared_pool(resolve_backend(backend))
    )


def _verify(
    response: str, ground_truth: Any, scoring: str, limits: Limits, pool: ZygotePool
) -> dict:
    backend = pool.backend
    try:
        truth = _parse_ground_truth(ground_truth)
    except (ValueError, TypeError) as exc:
        return _result("error", f"bad ground truth: {exc}", 0, 0, 0.0, backend)
    language = str(truth.get("language", "python")).lower()
    program, fence = extract_program(response or "")
    if language not in _PYTHON_TAGS or (fence and fence not in _PYTHON_TAGS):
        name = fence if language in _PYTHON_TAGS else language
        return _result(
            "error", f"language {name!r} is not supported (Python only)", 0, 0, 0.0, backend
        )
    if not program.strip():
        return _result("no_code", "the response holds no program", 0, 0, 0.0, backend)
    if truth.get("tests"):
        return _run_stdio(program, list(truth["tests"]), scoring, limits, pool)
    return _run_asserts(program, truth, scoring, limits, pool)


def code_reward(response: str, ground_truth: Any, **context: Any) -> dict:
    """Registry-signature reward: ``verify_code`` with ``extra_info``'s ``scoring`` and
    ``timeout_s`` (if given) and the auto-detected backend."""
    extra = context.get("extra_info") or {}
    limits = Limits(timeout_s=float(extra.get("timeout_s", Limits.timeout_s)))
    return verify_code(response, ground_truth, scoring=extra.get("scoring", "all"), limits=limits)


class CodeVerifier:
    """Batch code scoring: sandboxes run concurrently on a thread pool of ``workers``.

    Args:
        workers: concurrent sandboxes (default ``os.cpu_count()``).
        timeout_s: wall-clock deadline of each sandboxed run.
        scoring: "all" or "pass_rate" (an item's ``extra_info["scoring"]`` overrides it).
        backend: sandbox backend (see ``sandbox``); resolved once here.
        limits: other limits (``timeout_s`` overrides its deadline).
    """

    def __init__(
        self,
        workers: int | None = None,
        timeout_s: float = 5.0,
        scoring: str = "all",
        backend: str = "auto",
        limits: Limits | None = None,
    ) -> None:
        if scoring not in SCORINGS:
            raise ValueError(f"unknown scoring {scoring!r}; expected one of {SCORINGS}")
        self.scoring = scoring
        self.backend = resolve_backend(backend)
        self.limits = replace(limits or Limits(), timeout_s=timeout_s)
        workers = workers or os.cpu_count() or 1
        self._zygotes = ZygotePool(self.backend, workers)
        self._pool = ThreadPoolExecutor(max_workers=workers)

    def _score_one(self, item: dict) -> dict:
        try:
            extra = item.get("extra_info") or {}
            limits = self.limits
            if "timeout_s" in extra:
                limits = replace(limits, timeout_s=float(extra["timeout_s"]))
            scoring = extra.get("scoring", self.scoring)
            if scoring not in SCORINGS:
                raise ValueError(f"unknown scoring {scoring!r}; expected one of {SCORINGS}")
            response = item.get("response") or ""
            return _verify(response, item.get("ground_truth"), scoring, limits, self._zygotes)
        except Exception as exc:  # noqa: BLE001 - one bad item never fails the batch
            return _result("error", f"{type(exc).__name__}: {exc}", 0, 0, 0.0, self.backend)

    def score_batch(self, items: list[dict]) -> list[dict]:
        """Scores of ``items`` (``response``, ``ground_truth``, ``extra_info``), in order."""
        return list(self._pool.map(self._score_one, items))

    def close(self) -> None:
        """Wait for running items, then kill this verifier's zygotes."""
        self._pool.shutdown(wait=True)
        self._zygotes.close()

    def __enter__(self) -> CodeVerifier:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
