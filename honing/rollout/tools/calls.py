"""One turn's tool calls: parsed from the model's text, run concurrently under their bounds,
and answered with the tokens of the tool responses.

Calls are written in a ``ToolCallFormat``; ``hermes`` (Hermes, Qwen2.5/3) is a JSON object
between tags, one per call::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "2 ** 10"}}
    </tool_call>

Every complete call (an open tag with its close tag) is parsed; a malformed one, an unknown
tool or arguments that do not fit the tool's schema become a call with an ``error``, which
runs as an error result the model reads back. A call is the model's text, so any text is
read without raising: JSON nested past the interpreter's recursion limit or holding an
integer past Python's digit limit is a malformed call like any other. A call cut off by the
end of the text is left out.

Each call runs on a daemon thread of its own under its deadline. A user tool that hangs past
it cannot be killed and keeps its thread; at most ``MAX_TOOL_THREADS`` such threads run in a
process (``TOOL_THREADS``). A call that finds them all held waits for one within its own
deadline, and comes back at once, timed out, when every one is held by a call already past
its deadline.

Every text sent back to the model (outputs, error texts) is made encodable first
(``encodable``: a lone surrogate, which no tokenizer takes, is written as its escape).

Tool responses are rendered by the tokenizer's chat template: the conversation is rendered
with and without the tool messages and the difference taken (the closing of the assistant's
turn the model has not written yet, the tool messages, the next assistant header). A
tokenizer without a template (a base model, the built-in tiny model) gets
``FALLBACK_RESPONSE`` per result, after a newline, with nothing around the turn.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import Any

from honing.errors import ConfigError
from honing.rewards.registry import describe_error
from honing.rollout.tools.specs import Tool, ToolOutput, argument_problem

TRUNCATED = "\n[truncated]"
MAX_TOOL_THREADS = 32  # tool calls running at once in a process, hung ones included
FALLBACK_RESPONSE = "<tool_response>\n{output}\n</tool_response>\n"
_PROBE = "HONING-TOOL-PROBE"


@dataclass(frozen=True)
class ToolCallFormat:
    """How the model writes a call: its JSON object between ``open`` and ``close``."""

    name: str
    open: str
    close: str


FORMATS = {"hermes": ToolCallFormat("hermes", "<tool_call>", "</tool_call>")}


def tool_call_format(name: str) -> ToolCallFormat:
    """The format named ``name`` (``rollout.tool_format``).

    Raises:
        ConfigError: no format has that name.
    """
    if name not in FORMATS:
        raise ConfigError(f"unknown tool call format {name!r}; expected one of {sorted(FORMATS)}")
    return FORMATS[name]


@dataclass(frozen=True)
class ToolCall:
    """One call as the model wrote it; ``error`` says why it cannot run (malformed, unknown
    tool, arguments not matching the schema), as text the model reads back."""

    name: str
    arguments: dict = field(default_factory=dict)
    error: str | None = None
    text: str = ""


@dataclass(frozen=True)
class ToolResult:
    """How one call went: its bounded output (or error text) and what it cost."""

    name: str
    output: str
    error: bool = False
    timed_out: bool = False
    truncated: bool = False
    latency_s: float = 0.0


def parse_tool_calls(
    text: str,
    tools: Mapping[str, Tool],
    fmt: ToolCallFormat = FORMATS["hermes"],
    max_calls: int | None = None,
) -> list[ToolCall]:
    """Every complete call in ``text``, in order, checked against ``tools``; calls past
    ``max_calls`` are errors."""
    pattern = re.compile(re.escape(fmt.open) + r"(.*?)" + re.escape(fmt.close), re.DOTALL)
    calls = []
    for match in pattern.finditer(text):
        call = _parse_one(match.group(1), match.group(0), tools)
        if max_calls is not None and len(calls) >= max_calls and not call.error:
            call = ToolCall(
                call.name, call.arguments, f"more than {max_calls} calls in one turn", call.text
            )
        calls.append(call)
    return calls


def _parse_one(body: str, text: str, tools: Mapping[str, Tool]) -> ToolCall:
    expected = 'expected {"name": "<tool>", "arguments": {...}}'
    value, problem = _read_json(body)
    if problem:
        return ToolCall("", {}, f"malformed tool call: {problem}; {expected}", text)
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return ToolCall("", {}, f"malformed tool call: no tool name; {expected}", text)
    name, arguments = value["name"], value.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        decoded, problem = _read_json(arguments)
        arguments = arguments if problem else decoded
    if not isinstance(arguments, dict):
        return ToolCall(
            name, {}, f"malformed tool call: arguments are not an object; {expected}", text
        )
    return ToolCall(name, arguments, _call_problem(name, arguments, tools), text)


def _read_json(text: str) -> tuple[Any, str | None]:
    """``text`` as JSON and None, or None and why it cannot be read; never raises."""
    try:
        return json.loads(text), None
    except json.JSONDecodeError as exc:
        return None, f"{exc.msg} at character {exc.pos}"
    except RecursionError:
        return None, "nested too deeply"
    except ValueError:  # an integer literal past Python's int-to-string digit limit
        return None, "a number with too many digits"
    except MemoryError:
        return None, "too large to read"


def _call_problem(name: str, arguments: Mapping[str, Any], tools: Mapping[str, Tool]) -> str | None:
    """Why the call cannot run (an unknown tool, arguments that do not fit), or None."""
    if name not in tools:
        return f"unknown tool {name!r}; available: {', '.join(tools) or 'none'}"
    problem = argument_problem(tools[name].schema, arguments)
    return f"tool {name!r}: {problem}" if problem else None


def encodable(text: str) -> str:
    """``text`` with what UTF-8 cannot encode (a lone surrogate such as ``\\ud800``, which a
    tokenizer refuses) written as its backslash escape."""
    return text.encode("utf-8", errors="backslashreplace").decode("utf-8")


def bound_text(text: str, max_bytes: int) -> tuple[str, bool]:
    """``encodable(text)`` cut to ``max_bytes`` of UTF-8 (at a character boundary) +
    ``[truncated]``; and whether it was cut."""
    data = text.encode("utf-8", errors="backslashreplace")
    if len(data) <= max_bytes:
        return data.decode("utf-8"), False
    return data[:max_bytes].decode("utf-8", errors="ignore") + TRUNCATED, True


def iter_calls(
    calls: Sequence[ToolCall],
    tools: Mapping[str, Tool],
    timeout_s: float,
    max_output_bytes: int,
    workers: int = 8,
) -> Iterator[tuple[int, ToolResult]]:
    """Run ``calls`` on up to ``workers`` threads; yield ``(index, result)`` as each ends, so
    a slow call holds back no other. Never raises for a tool's failure."""
    if not calls:
        return
    with ThreadPoolExecutor(min(workers, len(calls)), thread_name_prefix="honing-tools") as pool:
        futures = {
            pool.submit(run_call, call, tools, timeout_s, max_output_bytes): index
            for index, call in enumerate(calls)
        }
        for future in as_completed(futures):
            yield futures[future], future.result()


def run_calls(
    calls: Sequence[ToolCall],
    tools: Mapping[str, Tool],
    timeout_s: float,
    max_output_bytes: int,
    workers: int = 8,
) -> list[ToolResult]:
    """The results of ``calls`` in their order (``iter_calls``)."""
    results: list[ToolResult | None] = [None] * len(calls)
    for index, result in iter_calls(calls, tools, timeout_s, max_output_bytes, workers):
        results[index] = result
    return results  # type: ignore[return-value]


def run_call(
    call: ToolCall, tools: Mapping[str, Tool], timeout_s: float, max_bytes: int
) -> ToolResult:
    """One call under its deadline: the tool runs on a ``TOOL_THREADS`` daemon thread that is
    waited for ``timeout_s`` (+ the tool's grace) and abandoned past it. Never raises."""
    started = time.monotonic()
    tool = tools.get(call.name)
    problem = call.error or _call_problem(call.name, call.arguments, tools)
    if problem or tool is None:
        return ToolResult(encodable(call.name), bound_text(f"error: {problem}", max_bytes)[0], True)

    def work() -> str | ToolOutput:
        return tool.run(call.arguments, timeout_s=timeout_s, max_output_bytes=max_bytes)

    job = TOOL_THREADS.run(work, f"honing-tool-{call.name}", timeout_s, tool.grace_s)
    latency_s = time.monotonic() - started
    if not job.done:
        text = f"error: tool {call.name!r} timed out after {timeout_s:g} s"
        if not job.started:
            text = (
                f"error: tool {call.name!r} not run: all {TOOL_THREADS.limit} tool threads are "
                f"held ({TOOL_THREADS.hung} by calls past their timeout)"
            )
        text = bound_text(text, max_bytes)[0]
        return ToolResult(call.name, text, error=True, timed_out=True, latency_s=latency_s)
    if job.error is not None:
        text = bound_text(f"error: {_describe(job.error)}", max_bytes)[0]
        return ToolResult(call.name, text, error=True, latency_s=latency_s)
    value = job.value
    output = value if isinstance(value, ToolOutput) else ToolOutput(str(value))
    text, cut = bound_text(output.text, max_bytes)
    if output.truncated and not cut:
        text += TRUNCATED
    return ToolResult(
        call.name, text, output.error, output.timed_out, output.truncated or cut, latency_s
    )


def _describe(error: BaseException) -> str:
    """``describe_error``, for an exception whose message is user code that may itself fail."""
    try:
        return describe_error(error)
    except Exception:  # noqa: BLE001 - a user exception's __str__ may raise anything
        return type(error).__name__


@dataclass
class ToolJob:
    """One call's run on a tool thread: its value or exception once ``done``; ``started``
    is False when no thread was free for it."""

    value: Any = None
    error: BaseException | None = None
    started: bool = False
    done: bool = False
    abandoned: bool = False


class ToolThreads:
    """The process's tool threads (module docstring): at most ``limit`` run at once, ``hung``
    of them for calls abandoned past their deadline."""

    def __init__(self, limit: int = MAX_TOOL_THREADS) -> None:
        self.limit = limit
        self.running = 0
        self.hung = 0
        self._changed = threading.Condition()

    def run(self, work: Callable[[], Any], name: str, timeout_s: float, grace_s: float) -> ToolJob:
        """``work()`` on a daemon thread, waited for ``timeout_s + grace_s``; the thread is
        started once one of ``limit`` is free, waiting for that at most ``timeout_s`` and not
        at all while every thread is hung."""
        job = ToolJob()
        if not self._take(timeout_s):
            return job

        def target() -> None:
            try:
                job.value = work()
            except BaseException as exc:  # noqa: BLE001 - a user tool may raise anything
                job.error = exc
            finally:
                with self._changed:
                    self.running -= 1
                    self.hung -= job.abandoned
                    job.done = True
                    self._changed.notify_all()

        thread = threading.Thread(target=target, name=name, daemon=True)
        try:
            thread.start()
        except RuntimeError:  # the system refuses another thread
            with self._changed:
                self.running -= 1
                self._changed.notify_all()
            return job
        job.started = True
        thread.join(timeout_s + grace_s)
        with self._changed:
            if not job.done:
                job.abandoned = True
                self.hung += 1
                self._changed.notify_all()
        return job

    def _take(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while self.running >= self.limit:
                left = deadline - time.monotonic()
                if self.hung >= self.limit or left <= 0:
                    return False
                self._changed.wait(left)
            self.running += 1
            return True


TOOL_THREADS = ToolThreads()
"""Every tool call's thread in this process (``run_call``)."""


class ToolResponses:
    """The text and tokens that follow a model's turn with tool calls: the rest of the turn's
    closing, the tool responses and the next assistant header (module docstring).

    Raises (when built):
        ConfigError: the chat template renders the earlier conversation differently once
            tool messages follow it, so no difference can be taken.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.templated = bool(getattr(tokenizer, "chat_template", None))
        self._base = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _PROBE}]
        self._before = self._render(self._base, generation_prompt=False) if self.templated else ""
        self.turn_end = self._before[self._before.rfind(_PROBE) + len(_PROBE) :]
        """What the template writes after an assistant turn's content (``<|im_end|>\\n``)."""
        self._closings = _closing_lengths(
            self.turn_end, getattr(tokenizer, "all_special_tokens", [])
        )
        self.text("", [ToolResult("probe", "probe")])

    def text(self, response_text: str, results: Sequence[ToolResult]) -> str:
        """What follows ``response_text`` (the turn the model wrote, special tokens kept):
        the part of ``turn_end`` it has not written, then the responses to ``results``
        (their texts made ``encodable``)."""
        if not self.templated:
            outputs = (encodable(r.output) for r in results)
            return "\n" + "".join(FALLBACK_RESPONSE.format(output=output) for output in outputs)
        messages = [
            {"role": "tool", "name": encodable(r.name), "content": encodable(r.output)}
            for r in results
        ]
        after = self._render(self._base + messages, generation_prompt=True)
        if not after.startswith(self._before):
            raise ConfigError(
                "the tokenizer's chat template renders a conversation differently once tool "
                "messages follow it; tool responses cannot be rendered by difference"
            )
        written = next(
            (size for size in self._closings if response_text.endswith(self.turn_end[:size])), 0
        )
        return self.turn_end[written:] + after[len(self._before) :]

    def ids(self, response_text: str, results: Sequence[ToolResult]) -> list[int]:
        """``text`` as token ids (no special tokens added)."""
        text = self.text(response_text, results)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt
            )
        except Exception as exc:  # noqa: BLE001 - templates raise jinja2 and other errors
            raise ConfigError(
                f"the tokenizer's chat template cannot render tool messages "
                f"({describe_error(exc)}); expected a template with a tool role"
            ) from None


def _closing_lengths(turn_end: str, specials: Sequence[str]) -> list[int]:
    """Lengths of ``turn_end``'s prefixes a response may end with, longest first: all of it,
    or up to a special token (the model stopped at its end-of-turn token)."""
    ends = {size for size in range(1, len(turn_end)) if turn_end[:size].endswith(tuple(specials))}
    return sorted(ends | {len(turn_end)}, reverse=True)
