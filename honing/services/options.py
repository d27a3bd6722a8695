"""The options of ``honing serve verifier|reward-model|rollout``.

Every number among them has a range, kept beside the option and checked by ``check_ranges``
before anything starts, so that a bad value is one line naming the option (``--port:
expected 0..65535, got 99999``) rather than a traceback or a server that refuses every
request.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass
from typing import Any, NamedTuple

from honing.errors import UserError


@dataclass(frozen=True)
class ServerLimits:
    """Connection limits of a service (``honing serve ... --header-timeout-s`` and so on)."""

    header_timeout_s: float = 10.0
    """Seconds a connection may take to send a complete request head."""
    max_connections: int = 512
    """Connections open at once; more are refused at once."""
    keep_alive_s: float = 5.0
    """Seconds an idle keep-alive connection stays open between requests."""


@dataclass(frozen=True)
class CompletionLimits:
    """What one completion request may ask of ``honing serve rollout`` (``--max-seq-len``,
    ``--max-tokens``, ``--max-sequences``): a request past them is refused with 400, so that
    no request can take more memory than these allow."""

    max_seq_len: int = 4096
    """Prompt + response tokens; a prompt must leave room for one response token, and a
    response stops where the sequence reaches it."""
    max_tokens: int = 4096
    """The ``max_tokens`` (response tokens per completion) a request may ask for."""
    max_sequences: int = 1024
    """Completions one request may ask for: its prompts times ``n``."""


class Range(NamedTuple):
    """The values an option allows: from ``low`` (excluded when ``low_open``) up to ``high``
    (``None``: no bound); never NaN or infinite."""

    low: float
    high: float | None = None
    low_open: bool = False

    def __contains__(self, value: object) -> bool:
        if not isinstance(value, int | float) or isinstance(value, bool):
            return False
        if isinstance(value, float) and not math.isfinite(value):
            return False
        above_low = value > self.low if self.low_open else value >= self.low
        return above_low and (self.high is None or value <= self.high)

    def __str__(self) -> str:
        if self.high is not None and self.low_open:
            return f"> {self.low} and <= {self.high}"
        if self.high is not None:
            return f"{self.low}..{self.high}"
        return f"> {self.low}" if self.low_open else f">= {self.low}"


NON_NEGATIVE = Range(0)
AT_LEAST_ONE = Range(1)
POSITIVE = Range(0, low_open=True)
PORT = Range(0, 65535)  # 0: the system picks a free port


def add_serve_options(commands: argparse._SubParsersAction) -> None:
    """``honing serve`` and its three services, as subcommands of ``commands``."""
    serve = commands.add_parser("serve", help="run a scoring service over HTTP")
    kinds = serve.add_subparsers(dest="service", required=True)
    verifier = kinds.add_parser("verifier", help="math / code / numeric verifiers at POST /score")
    rollout = kinds.add_parser(
        "rollout", help="a policy behind the OpenAI completions API, with weight updates"
    )
    model = kinds.add_parser("reward-model", help="a sequence-classification reward model")
    for sub in (verifier, rollout, model):
        sub.set_defaults(number_ranges={})
    _verifier(verifier)
    _rollout(rollout)
    _reward_model(model)
    for sub in (verifier, model, rollout):
        token_variable = "HONING_ROLLOUT_TOKEN" if sub is rollout else "HONING_VERIFIER_TOKEN"
        _server(sub, token_variable)
        if sub is not rollout:
            _scoring_guards(sub)


def check_ranges(ns: argparse.Namespace) -> None:
    """Raises ``UserError`` naming the first number option outside its range."""
    for flag, allowed in ns.number_ranges.items():
        value = getattr(ns, flag.removeprefix("--").replace("-", "_"))
        if value not in allowed:
            raise UserError(f"{flag}: expected {allowed}, got {value}")


def _number(
    sub: argparse.ArgumentParser,
    flag: str,
    kind: type,
    default: float,
    allowed: Range,
    **options: Any,
) -> None:
    sub.add_argument(flag, type=kind, default=default, **options)
    sub.get_default("number_ranges")[flag] = allowed


def _verifier(sub: argparse.ArgumentParser) -> None:
    _number(
        sub,
        "--workers",
        int,
        0,
        NON_NEGATIVE,
        help="math processes and programs run at once (default: one per core)",
    )
    sub.add_argument(
        "--function",
        default="",
        help="reward function for data sources "
        "the built-in routes do not know (module:function or file.py:function)",
    )
    sub.add_argument(
        "--route",
        action="append",
        default=[],
        metavar="DATA_SOURCE=SPEC",
        help="score a data source with a reward function (repeatable)",
    )
    _number(sub, "--math-timeout-s", float, 5.0, POSITIVE)
    _number(sub, "--code-timeout-s", float, 10.0, POSITIVE)
    _number(
        sub,
        "--delay-ms",
        float,
        0.0,
        NON_NEGATIVE,
        help="hold each request this long before scoring (to measure slow scoring)",
    )


def _rollout(sub: argparse.ArgumentParser) -> None:
    sub.add_argument("--model", required=True, help="local model directory or builtin:tiny")
    sub.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    sub.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    limits = CompletionLimits()
    _number(
        sub,
        "--max-seq-len",
        int,
        limits.max_seq_len,
        Range(2),
        help="prompt + response tokens; a longer prompt is refused "
        f"(default: {limits.max_seq_len})",
    )
    _number(
        sub,
        "--max-tokens",
        int,
        limits.max_tokens,
        AT_LEAST_ONE,
        help=f"the most max_tokens a request may ask for (default: {limits.max_tokens})",
    )
    _number(
        sub,
        "--max-sequences",
        int,
        limits.max_sequences,
        AT_LEAST_ONE,
        help="the most completions (prompts x n) one request may ask for "
        f"(default: {limits.max_sequences})",
    )
    sub.add_argument("--name", default="", help="served model name (default: the path)")
    _number(sub, "--threads", int, 0, NON_NEGATIVE, help="torch threads (0 = default)")
    _number(
        sub,
        "--exit-after",
        int,
        0,
        NON_NEGATIVE,
        metavar="N",
        help="fault injection: die without answering the N-th completion request",
    )
    sub.add_argument(
        "--speculative",
        default="off",
        choices=("off", "ngram", "draft"),
        help="speculative decoding in the served engine (counters at GET /metrics)",
    )
    _number(sub, "--spec-tokens", int, 4, AT_LEAST_ONE, help="draft tokens per round")
    sub.add_argument("--spec-draft", default="", help="--speculative draft: the draft model")


def _reward_model(sub: argparse.ArgumentParser) -> None:
    sub.add_argument("--model", required=True, help="local Hugging Face model directory")
    sub.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    _number(sub, "--max-batch", int, 32, AT_LEAST_ONE, help="items per forward pass")
    _number(sub, "--max-wait-ms", float, 5.0, NON_NEGATIVE, help="how long a batch waits to fill")
    _number(sub, "--max-length", int, 2048, AT_LEAST_ONE, help="tokens per item")


def _server(sub: argparse.ArgumentParser, token_variable: str) -> None:
    """Where a service listens, who may call it, and its connection limits."""
    limits = ServerLimits()
    sub.add_argument("--host", default="127.0.0.1", help="default: loopback only")
    _number(sub, "--port", int, 8080, PORT, help="0: a free port (printed)")
    sub.add_argument(
        "--token",
        default=os.environ.get(token_variable, ""),
        help=f"require 'Authorization: Bearer TOKEN' (default: ${token_variable})",
    )
    _number(
        sub,
        "--header-timeout-s",
        float,
        limits.header_timeout_s,
        POSITIVE,
        help="close a connection that has not sent a whole request head in this time "
        f"(default: {limits.header_timeout_s:g})",
    )
    _number(
        sub,
        "--max-connections",
        int,
        limits.max_connections,
        AT_LEAST_ONE,
        help="connections open at once; more are refused at once "
        f"(default: {limits.max_connections})",
    )
    _number(
        sub,
        "--keep-alive-s",
        float,
        limits.keep_alive_s,
        POSITIVE,
        help="close a keep-alive connection idle this long between requests "
        f"(default: {limits.keep_alive_s:g})",
    )


def _scoring_guards(sub: argparse.ArgumentParser) -> None:
    """The request limits of the scoring services (``honing.services.app``)."""
    _number(sub, "--max-concurrency", int, 8, AT_LEAST_ONE, help="requests scored at once")
    _number(
        sub,
        "--max-queue",
        int,
        64,
        NON_NEGATIVE,
        help="requests waiting; more are refused with 503",
    )
    _number(sub, "--max-body-mb", float, 16.0, POSITIVE, help="request body limit (413 past it)")
