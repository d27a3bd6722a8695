"""Tools a policy calls during a multi-turn rollout: their specs, the run's registry, and
bounded concurrent execution of one turn's calls.

A tool is a name, a JSON schema in the OpenAI function-calling form (what
``tokenizer.apply_chat_template(messages, tools=[...])`` renders) and a callable. Built in:

- ``python``: the ``code`` argument runs as a file in a fresh ``python3 -I`` inside honing's
  sandbox (``sandbox/isolation.py``: no network, private directory, rlimits, the reward
  sandbox's ``Limits``), with the call's timeout; the result is stdout, then stderr, then
  ``[exit status N]`` when it did not exit with 0.
- ``calculator``: an arithmetic ``expression`` evaluated exactly, never by ``eval``
  (``rollout/tools/calculator.py``: its grammar, bounds and output).

A user tool is ``package.module:function`` or ``path/to/file.py:function``, loaded by the
reward functions' loader (``rewards/registry.load_callable``). Its schema is derived from
its signature and docstring: every parameter is named (no ``*args``/``**kwargs``) and
annotated ``str``, ``int``, ``float`` or ``bool``; a parameter without a default is
required; the docstring's first paragraph is the tool's description and its ``Args:``
lines (``name: text``) describe the parameters. It is called with the arguments as keywords
and returns a string (anything else is sent as JSON). User tools run in this process,
trusted: what they print is not captured, and one that hangs past its timeout is reported
and left running on its daemon thread (Python cannot kill a thread); ``rollout/tools/calls.py``
bounds how many such threads a process keeps.

How a turn's calls are parsed, run and answered is ``rollout/tools/calls.py``.
"""

from __future__ import annotations

import inspect
import json
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from honing.errors import ConfigError, RewardError
from honing.rewards.registry import describe_error, load_callable
from honing.rollout.tools.calculator import CalculatorError, calculate
from honing.sandbox.isolation import Limits, run_sandboxed, sandbox_python

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean"}
_CHECKS: dict[str, Callable[[Any], bool]] = {
    "string": lambda value: isinstance(value, str),
    "integer": lambda value: isinstance(value, int) and not isinstance(value, bool),
    "number": lambda value: isinstance(value, int | float) and not isinstance(value, bool),
    "boolean": lambda value: isinstance(value, bool),
}


@dataclass(frozen=True)
class ToolSettings:
    """How a run's rollouts use tools (the ``rollout.tool*`` / ``max_*`` config keys)."""

    tools: tuple[str, ...] = ()
    """Built-in names (``python``, ``calculator``) and user specs; empty = no tools."""
    max_turns: int = 4
    """Assistant turns per sample; the last one gets no tool responses."""
    max_tool_calls: int = 4
    """Calls run per turn; further calls in the same turn get an error result."""
    tool_timeout_s: float = 10.0
    """Wall-clock deadline of one call."""
    tool_output_bytes: int = 4096
    """Bytes of UTF-8 kept of one call's output."""
    tool_format: str = "hermes"
    """How calls are written in the model's text (``rollout/tools/calls.FORMATS``)."""


@dataclass(frozen=True)
class ToolOutput:
    """What a tool returns when it has more to say than its text."""

    text: str
    error: bool = False
    timed_out: bool = False
    truncated: bool = False


@dataclass(frozen=True)
class Tool:
    """A callable the model may call by ``name``. ``run(arguments, timeout_s=...,
    max_output_bytes=...)`` returns a string or a ``ToolOutput`` and may raise (the
    exception becomes an error result). ``grace_s``: how long past the timeout to wait for a
    tool that enforces the deadline itself (the sandbox) and reports what it had."""

    name: str
    schema: dict
    run: Callable[..., str | ToolOutput]
    grace_s: float = 0.0


def function_schema(name: str, description: str, parameters: dict, required: list[str]) -> dict:
    """The OpenAI function-calling schema of a tool."""
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": parameters, "required": required},
        },
    }


def argument_problem(schema: dict, arguments: Mapping[str, Any]) -> str | None:
    """Why ``arguments`` do not fit ``schema`` (missing, unknown or mistyped), or None."""
    parameters = schema["function"]["parameters"]
    properties = parameters.get("properties", {})
    missing = [name for name in parameters.get("required", ()) if name not in arguments]
    if missing:
        return f"missing argument(s) {', '.join(missing)}"
    unknown = [name for name in arguments if name not in properties]
    if unknown:
        return f"unknown argument(s) {', '.join(unknown)}; expected {', '.join(properties)}"
    for name, value in arguments.items():
        expected = properties[name].get("type")
        if expected in _CHECKS and not _CHECKS[expected](value):
            return f"argument {name!r} must be {expected}, got {type(value).__name__}"
    return None


def python_tool(limits: Limits | None = None, backend: str = "auto") -> Tool:
    """The built-in ``python`` tool over the sandbox, with ``limits`` (the reward sandbox's
    by default) whose timeout and output bound each call replaces with its own."""
    base = limits or Limits()

    def run(arguments: dict, *, timeout_s: float, max_output_bytes: int) -> ToolOutput:
        call_limits = replace(base, timeout_s=timeout_s, max_output_bytes=max_output_bytes)
        done = run_sandboxed(
            [sandbox_python(backend), "-I", "main.py"],
            files={"main.py": arguments["code"]},
            limits=call_limits,
            backend=backend,
        )
        parts = [done.stdout, done.stderr]
        if done.timed_out:
            parts.append(f"[timed out after {timeout_s:g} s]")
        elif done.signal:
            parts.append(f"[killed by {done.signal}]")
        elif done.returncode != 0:
            parts.append(f"[exit status {done.returncode}]")
        text = "\n".join(part.rstrip("\n") for part in parts if part)
        cut = done.stdout_truncated or done.stderr_truncated
        failed = done.timed_out or done.returncode != 0
        return ToolOutput(text, error=failed, timed_out=done.timed_out, truncated=cut)

    description = (
        "Run a Python 3 program in a fresh sandboxed interpreter (no network, no files kept "
        "between calls) and return what it printed (stdout, then stderr)."
    )
    code = {"code": {"type": "string", "description": "The program; print what you need."}}
    return Tool("python", function_schema("python", description, code, ["code"]), run, 2.0)


def calculator_tool() -> Tool:
    """The built-in ``calculator`` tool: ``calculator.calculate``, a refusal as an error result."""

    def run(arguments: dict, **_budget: Any) -> str | ToolOutput:
        try:
            return calculate(arguments["expression"])
        except CalculatorError as exc:
            return ToolOutput(f"error: {exc}", error=True)

    description = (
        "Evaluate an arithmetic expression exactly: integers and decimals, + - * / // % ** "
        "and parentheses."
    )
    expression = {"expression": {"type": "string", "description": "e.g. (12345678 * 87) // 7"}}
    return Tool(
        "calculator", function_schema("calculator", description, expression, ["expression"]), run
    )


def user_tool(spec: str) -> Tool:
    """A user tool from ``package.module:function`` or ``path/to/file.py:function``.

    Raises:
        ConfigError: it cannot be loaded, or its signature is not one a schema can describe.
    """
    try:
        fn = load_callable(spec, kind="tool")
    except RewardError as exc:
        raise ConfigError(str(exc)) from None
    name = getattr(fn, "__name__", spec.rpartition(":")[2])
    schema = signature_schema(name, fn, spec)

    def run(arguments: dict, **_budget: Any) -> str:
        value = fn(**arguments)
        return value if isinstance(value, str) else json.dumps(value, default=str)

    return Tool(name, schema, run)


def signature_schema(name: str, fn: Callable, spec: str) -> dict:
    """The schema of ``fn`` from its signature and docstring (module docstring's rules).

    Raises:
        ConfigError: a parameter is variadic or not annotated with str, int, float or bool.
    """
    try:
        hints = typing.get_type_hints(fn)
    except Exception as exc:  # noqa: BLE001 - annotations are user code
        raise ConfigError(
            f"tool {spec!r}: cannot read its annotations ({describe_error(exc)})"
        ) from None
    documented = _documented_arguments(inspect.getdoc(fn) or "")
    properties, required = {}, []
    for parameter in inspect.signature(fn).parameters.values():
        kind = _JSON_TYPES.get(hints.get(parameter.name))
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD) or kind is None:
            raise ConfigError(
                f"tool {spec!r}: parameter {parameter.name!r} cannot be described; expected "
                "named parameters annotated str, int, float or bool"
            )
        properties[parameter.name] = {"type": kind}
        if parameter.name in documented:
            properties[parameter.name]["description"] = documented[parameter.name]
        if parameter.default is parameter.empty:
            required.append(parameter.name)
    summary = (inspect.getdoc(fn) or name).split("\n\n")[0].replace("\n", " ")
    return function_schema(name, summary, properties, required)


def _documented_arguments(doc: str) -> dict[str, str]:
    """``name -> text`` from a Google-style ``Args:`` section."""
    found, inside = {}, False
    for line in doc.splitlines():
        stripped = line.strip()
        if stripped in ("Args:", "Arguments:", "Parameters:"):
            inside = True
        elif inside and stripped and not line.startswith(" "):
            break
        elif inside and ":" in stripped:
            name, _, text = stripped.partition(":")
            found[name.split(" ")[0]] = text.strip()
    return found


def build_tools(
    specs: Sequence[str], limits: Limits | None = None, backend: str = "auto"
) -> dict[str, Tool]:
    """The run's tools by name from ``specs`` (``python``, ``calculator`` or a user spec).

    Raises:
        ConfigError: an unknown name, a user tool that cannot be loaded, or two tools with
            one name.
    """
    tools: dict[str, Tool] = {}
    for spec in specs:
        spec = spec.strip()
        if spec == "python":
            tool = python_tool(limits, backend)
        elif spec == "calculator":
            tool = calculator_tool()
        elif ":" in spec:
            tool = user_tool(spec)
        else:
            raise ConfigError(
                f"unknown tool {spec!r}; expected python, calculator, "
                "'package.module:function' or 'path/to/file.py:function'"
            )
        if tool.name in tools:
            raise ConfigError(f"two tools are named {tool.name!r} (from {spec!r}); rename one")
        tools[tool.name] = tool
    return tools
