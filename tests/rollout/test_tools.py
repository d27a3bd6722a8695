"""The tool layer: specs, tool-call parsing (any text the model writes), the python tool in the real
sandbox under hostile programs, concurrent bounded execution and the bound on hung threads,
user tools, and the tool
responses as a chat template and the built-in tokenizer render them."""

import json
import re
import socket
import threading
import time
import uuid

import pytest

from honing.errors import ConfigError
from honing.models.tiny import build_tokenizer
from honing.rollout.tools.calls import (
    FALLBACK_RESPONSE,
    MAX_TOOL_THREADS,
    ToolCall,
    ToolResponses,
    ToolResult,
    iter_calls,
    parse_tool_calls,
    run_calls,
    tool_call_format,
)
from honing.rollout.tools.specs import Tool, build_tools, function_schema
from tests.sandbox._processes import processes_with

TOOLS = build_tools(["python", "calculator"])
OUTPUT_BYTES = 4096

USER_TOOLS = '''
import time


def add(a: int, b: int, note: str = "") -> str:
    """Add two integers.

    Args:
        a: the first addend.
        b: the second addend.
        note: ignored.
    """
    return str(a + b)


def scale(x: float, by: float = 2.0, exact: bool = False) -> dict:
    return {"value": x * by, "exact": exact}


def explode(message: str) -> str:
    raise RuntimeError(f"bad input\\n{message}")


def stuck(seconds: float) -> str:
    time.sleep(seconds)
    return "woke"


def flood(megabytes: int) -> str:
    return "z" * (megabytes << 20)


def untyped(x):
    return x
'''

QWEN_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""Qwen2.5's chat template, cut to its tool parts: consecutive tool messages share one
``user`` turn of ``<tool_response>`` blocks."""


def _call(name: str, **arguments) -> ToolCall:
    return ToolCall(name, arguments)


def _python(code: str, timeout_s: float = 5.0, max_bytes: int = OUTPUT_BYTES) -> ToolResult:
    return run_calls([_call("python", code=code)], TOOLS, timeout_s, max_bytes)[0]


def _chat_tokenizer():
    """A character-level tokenizer with ChatML special tokens and a Qwen-style template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<|im_start|>", "<|im_end|>", "<unk>"]
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    core = Tokenizer(models.WordLevel({t: i for i, t in enumerate(specials + chars)}, "<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        eos_token="<|im_end|>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.chat_template = QWEN_TEMPLATE
    return tokenizer


# Specs (the calculator: test_calculator.py)


def test_builtin_schemas_are_openai_function_specs():
    python = TOOLS["python"].schema
    assert python["type"] == "function" and python["function"]["name"] == "python"
    parameters = python["function"]["parameters"]
    assert parameters["type"] == "object" and parameters["required"] == ["code"]
    assert parameters["properties"]["code"]["type"] == "string"
    assert TOOLS["calculator"].schema["function"]["parameters"]["required"] == ["expression"]


@pytest.mark.parametrize("spec", ["shell", "python3"])
def test_unknown_tool_name_is_a_config_error(spec):
    with pytest.raises(ConfigError, match=f"unknown tool '{spec}'; expected python, calculator"):
        build_tools([spec])


# Parsing


def test_one_call():
    body = '{"name": "calculator", "arguments": {"expression": "2 ** 10"}}'
    text = f"Let me check.\n<tool_call>\n{body}\n</tool_call>"
    [call] = parse_tool_calls(text, TOOLS, tool_call_format("hermes"))
    assert (call.name, call.arguments, call.error) == (
        "calculator",
        {"expression": "2 ** 10"},
        None,
    )
    assert call.text == text[text.index("<tool_call>") :]
    assert run_calls([call], TOOLS, 5.0, 100)[0].output == "1024"


def test_two_calls_in_order_and_a_cut_off_one_left_out():
    text = (
        '<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call> then '
        '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1+1\\"}"}'
        "</tool_call>"
        '<tool_call>{"name": "calculator", "argu'
    )
    calls = parse_tool_calls(text, TOOLS)
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("python", {"code": "print(1)"}, None),
        ("calculator", {"expression": "1+1"}, None),
    ]


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (
            '{"name": "calculator", "arguments": {"expression": "1"}',
            "malformed tool call: Expecting",
        ),
        ("[1, 2]", "malformed tool call: no tool name"),
        ('{"name": "calculator", "arguments": [1]}', "arguments are not an object"),
        (
            '{"name": "shell", "arguments": {"cmd": "ls"}}',
            "unknown tool 'shell'; available: python, calculator",
        ),
        (
            '{"name": "calculator", "arguments": {"expression": 12}}',
            "argument 'expression' must be string, got int",
        ),
        ('{"name": "calculator", "arguments": {}}', "missing argument(s) expression"),
        (
            '{"name": "calculator", "arguments": {"expression": "1", "x": 2}}',
            "unknown argument(s) x",
        ),
    ],
)
def test_bad_calls_are_errors_the_model_reads(body, error):
    [call] = parse_tool_calls(f"<tool_call>{body}</tool_call>", TOOLS)
    assert error in call.error
    [result] = run_calls([call], TOOLS, 5.0, OUTPUT_BYTES)
    assert result.error and error in result.output and result.output.startswith("error: ")


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ("[" * 1000, "malformed tool call: "),  # too deep, or unclosed: where the stack is
        ("[" * 100_000, "malformed tool call: nested too deeply"),
        ('{"a": ' * 100_000, "malformed tool call: nested too deeply"),
        ('{"name": "calculator", "arguments": "' + "[" * 1000 + '"}', "are not an object"),
        (
            '{"name": "calculator", "arguments": {"expression": "1"}, "n": ' + "7" * 4301 + "}",
            "malformed tool call: a number with too many digits",
        ),
        (
            '{"name": "calculator", "arguments": {"expression": ' + "7" * 5000 + "}}",
            "malformed tool call: a number with too many digits",
        ),
        (
            '{"name": "calculator", "arguments": {"expression": "1", "\\ud800": 1}}',
            "unknown argument(s) \\ud800; expected expression",
        ),
        ('{"name": "\\udfff", "arguments": {}}', "unknown tool '\\udfff'"),
    ],
)
def test_any_text_in_a_call_is_an_error_result_never_an_exception(body, error):
    """Text that makes Python's JSON reader raise (recursion, an integer past the digit
    limit) and names holding a lone surrogate: each is an error result whose text a
    tokenizer takes."""
    [call] = parse_tool_calls(f"<tool_call>{body}</tool_call>", TOOLS)
    [result] = run_calls([call], TOOLS, 5.0, OUTPUT_BYTES)
    assert result.error and error in result.output, result.output
    result.output.encode("utf-8")  # no lone surrogate left
    tokenizer = build_tokenizer(tool_tags=True)
    assert ToolResponses(tokenizer).ids("", [result])


def test_calls_past_the_turn_limit_are_errors():
    one = '<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}</tool_call>'
    calls = parse_tool_calls(one * 3, TOOLS, max_calls=2)
    assert [c.error for c in calls] == [None, None, "more than 2 calls in one turn"]


def test_unknown_format_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown tool call format 'xml'"):
        tool_call_format("xml")


# The python tool in the sandbox


def test_python_tool_returns_stdout_stderr_and_exit_status():
    result = _python("import sys\nprint('out')\nprint('err', file=sys.stderr)\nsys.exit(3)")
    assert result.output == "out\nerr\n[exit status 3]" and result.error
    fine = _python("print(6 * 7)")
    assert (fine.output, fine.error, fine.timed_out, fine.truncated) == ("42", False, False, False)
    assert 0 < fine.latency_s < 4.0


def test_fork_bomb_is_bounded_and_leaves_nothing():
    marker = f"honing-test-{uuid.uuid4().hex}"
    bomb = f"# {marker}\nimport os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n"
    bomb += "        pass"
    code = f"import os, sys\nos.execv(sys.executable, [sys.executable, '-I', '-c', {bomb!r}])"
    result = _python(code, timeout_s=1.5)
    assert result.timed_out and result.error and "[timed out after 1.5 s]" in result.output
    assert result.latency_s < 4.0
    time.sleep(0.1)
    assert processes_with(marker) == []


def test_ten_gigabyte_allocation_fails_inside():
    result = _python("blob = bytearray(10 * 1024**3)\nprint('allocated')")
    assert result.error and "MemoryError" in result.output and "allocated" not in result.output
    assert "[exit status 1]" in result.output


@pytest.fixture
def listener():
    """A TCP socket listening on loopback, for a program that should not reach it."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(0.2)
        yield server


def test_network_is_unreachable(listener):
    targets = [("127.0.0.1", listener.getsockname()[1]), ("1.1.1.1", 53)]
    code = (
        "import socket\n"
        f"for address in {targets!r}:\n"
        "    try:\n        socket.create_connection(address, timeout=1)\n        print('reached')\n"
        "    except OSError as e:\n        print('unreachable', type(e).__name__)"
    )
    result = _python(code)
    assert result.output.count("unreachable") == 2 and "reached\n" not in result.output
    with pytest.raises(TimeoutError):
        listener.accept()


def test_files_outside_its_directory_are_unreadable_and_unwritable(tmp_path):
    secret = tmp_path / "id_fake"
    secret.write_text("SECRET-KEY-MATERIAL")
    secret.chmod(0o600)
    code = (
        f"for path in ('/etc/shadow', {str(secret)!r}):\n"
        "    try:\n        print(open(path).read())\n"
        "    except OSError as e:\n        print('blocked', type(e).__name__)\n"
        f"try:\n    open({str(tmp_path / 'planted')!r}, 'w')\nexcept OSError as e:\n"
        "    print('blocked', type(e).__name__)"
    )
    result = _python(code)
    assert "SECRET" not in result.output and "root:" not in result.output
    assert result.output.count("blocked") == 3, result.output
    assert not (tmp_path / "planted").exists()


def test_hundred_megabytes_of_output_are_cut_to_the_bound():
    result = _python("import sys\nsys.stdout.write('y' * 100_000_000)", max_bytes=1000)
    assert result.truncated and result.output == "y" * 1000 + "\n[truncated]"
    assert not result.timed_out and result.latency_s < 4.0
    both = _python(
        "import sys\nprint('o' * 800)\nprint('e' * 800, file=sys.stderr)", max_bytes=1000
    )
    assert both.truncated and both.output == "o" * 800 + "\n" + "e" * 199 + "\n[truncated]"


# Concurrency


@pytest.mark.alone
def test_a_slow_call_holds_back_no_other():
    """Three quick programs come back long before one that sleeps 3 s, and that one is ended
    at its 2 s timeout."""
    calls = [_call("python", code="import time\ntime.sleep(3)\nprint('late')")]
    calls += [_call("python", code=f"print({index})") for index in range(3)]
    started = time.monotonic()
    arrivals = {
        index: (time.monotonic() - started, result)
        for index, result in iter_calls(calls, TOOLS, timeout_s=2.0, max_output_bytes=OUTPUT_BYTES)
    }
    quick = [arrivals[index][0] for index in (1, 2, 3)]
    assert max(quick) < 1.5, arrivals
    assert [arrivals[index][1].output for index in (1, 2, 3)] == ["0", "1", "2"]
    slow_s, slow = arrivals[0]
    assert slow.timed_out and "late" not in slow.output and 2.0 <= slow_s < 2.9, arrivals


# User tools


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_tools.py"
    path.write_text(USER_TOOLS)
    return path


def test_user_tool_from_a_file_with_its_schema(user_file):
    tools = build_tools([f"{user_file}:add", f"{user_file}:scale", "calculator"])
    assert list(tools) == ["add", "scale", "calculator"]
    assert tools["add"].schema == {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "description": "the first addend."},
                    "b": {"type": "integer", "description": "the second addend."},
                    "note": {"type": "string", "description": "ignored."},
                },
                "required": ["a", "b"],
            },
        },
    }
    scale = tools["scale"].schema["function"]
    assert scale["description"] == "scale"
    assert {k: v["type"] for k, v in scale["parameters"]["properties"].items()} == {
        "x": "number",
        "by": "number",
        "exact": "boolean",
    }
    text = (
        '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
        '<tool_call>{"name": "scale", "arguments": {"x": 1.5, "exact": true}}</tool_call>'
        '<tool_call>{"name": "add", "arguments": {"a": "2", "b": 3}}</tool_call>'
    )
    results = run_calls(parse_tool_calls(text, tools), tools, 5.0, OUTPUT_BYTES)
    assert [r.output for r in results[:2]] == ["5", json.dumps({"value": 3.0, "exact": True})]
    assert results[2].error and "argument 'a' must be integer, got str" in results[2].output


def test_a_user_tool_that_raises_or_hangs_is_an_error_result(user_file):
    tools = build_tools([f"{user_file}:explode", f"{user_file}:stuck"])
    calls = [
        _call("explode", message="boom"),
        _call("stuck", seconds=2.0),
        _call("stuck", seconds=0.0),
    ]
    started = time.monotonic()
    raised, hung, quick = run_calls(calls, tools, timeout_s=0.3, max_output_bytes=OUTPUT_BYTES)
    assert time.monotonic() - started < 1.5
    assert raised.error and raised.output == "error: RuntimeError: bad input boom"
    assert hung.timed_out and hung.output == "error: tool 'stuck' timed out after 0.3 s"
    assert quick.output == "woke" and not quick.error


def test_hung_calls_hold_at_most_the_thread_bound():
    """200 calls of a tool that hangs: at most MAX_TOOL_THREADS threads are kept for them,
    each call comes back as a timeout (past the bound at once: not run, no thread free), and
    the threads are free again once the tool returns."""
    release = threading.Event()

    def hang(arguments: dict, **_budget) -> str:
        return "released" if release.wait() else "never"

    tools = {"hang": Tool("hang", function_schema("hang", "Hangs.", {}, []), hang)}
    before = threading.active_count()
    try:
        started = time.monotonic()
        results = run_calls([ToolCall("hang")] * 200, tools, 0.05, OUTPUT_BYTES)
        elapsed = time.monotonic() - started
        assert threading.active_count() - before <= MAX_TOOL_THREADS
        assert all(r.timed_out and r.error for r in results)
        refused = [r for r in results if "not run: all 32 tool threads are held" in r.output]
        assert len(refused) >= 200 - MAX_TOOL_THREADS and elapsed < 3.0
    finally:
        release.set()
    deadline = time.monotonic() + 5.0
    while any(t.name == "honing-tool-hang" for t in threading.enumerate()):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    [again] = run_calls([ToolCall("hang")], tools, 1.0, OUTPUT_BYTES)
    assert again.output == "released" and not again.error


def test_a_user_tool_returning_a_lone_surrogate_or_raising_an_unprintable_error():
    class Unprintable(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no message")

    def surrogate(arguments: dict, **_budget) -> str:
        return "value \ud800"

    def unprintable(arguments: dict, **_budget) -> str:
        raise Unprintable

    schema = function_schema("t", "A tool.", {}, [])
    tools = {"s": Tool("s", schema, surrogate), "u": Tool("u", schema, unprintable)}
    lone, raised = run_calls([ToolCall("s"), ToolCall("u")], tools, 5.0, OUTPUT_BYTES)
    assert lone.output == "value \\ud800" and not lone.error
    assert raised.error and raised.output == "error: Unprintable"


def test_a_user_tool_returning_100_megabytes_is_cut_to_the_bound(user_file):
    tools = build_tools([f"{user_file}:flood"])
    [result] = run_calls([_call("flood", megabytes=100)], tools, 5.0, max_output_bytes=2000)
    assert result.truncated and result.output == "z" * 2000 + "\n[truncated]"


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("untyped", "parameter 'x' cannot be described; expected named parameters annotated"),
        ("missing", "has no attribute 'missing' (tool '"),
    ],
)
def test_user_tools_that_cannot_be_described_or_found(user_file, name, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as error:
        build_tools([f"{user_file}:{name}"])
    assert "\n" not in str(error.value)


def test_user_tool_file_missing_and_names_taken_twice(user_file, tmp_path):
    with pytest.raises(ConfigError, match="tool file not found: .*nope.py"):
        build_tools([f"{tmp_path / 'nope.py'}:add"])
    with pytest.raises(ConfigError, match="two tools are named 'add'"):
        build_tools([f"{user_file}:add", f"{user_file}:add"])


# Rendering tool responses


def test_responses_rendered_by_a_chat_template():
    tokenizer = _chat_tokenizer()
    responses = ToolResponses(tokenizer)
    assert responses.turn_end == "<|im_end|>\n"
    results = [ToolResult("python", "4"), ToolResult("calculator", "error: division by zero")]
    turn = '<tool_call>{"name": "python", "arguments": {"code": "print(4)"}}</tool_call>'
    expected = (
        "<|im_start|>user\n<tool_response>\n4\n</tool_response>\n<tool_response>\n"
        "error: division by zero\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert responses.text(turn + "<|im_end|>", results) == "\n" + expected
    assert responses.text(turn, results) == "<|im_end|>\n" + expected  # stopped at the tag
    # The tokens continue the model's own tokens as the whole conversation renders them.
    conversation = [
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": turn},
        *({"role": "tool", "content": r.output} for r in results),
    ]
    whole = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    prompt = tokenizer.apply_chat_template(
        conversation[:1], add_generation_prompt=True, tokenize=False
    )
    generated = tokenizer(turn + "<|im_end|>", add_special_tokens=False)["input_ids"]
    continued = generated + responses.ids(turn + "<|im_end|>", results)
    assert (
        tokenizer(prompt, add_special_tokens=False)["input_ids"] + continued
        == tokenizer(whole, add_special_tokens=False)["input_ids"]
    )
    schemas = [TOOLS["python"].schema]
    assert json.dumps(schemas[0]) in tokenizer.apply_chat_template(
        conversation, tools=schemas, tokenize=False
    )


def test_responses_without_a_chat_template_use_the_plain_format():
    tokenizer = build_tokenizer()
    responses = ToolResponses(tokenizer)
    results = [ToolResult("calculator", "1024"), ToolResult("python", "hi")]
    text = responses.text("<tool_call>...</tool_call>", results)
    assert text == "\n" + FALLBACK_RESPONSE.format(output="1024") + FALLBACK_RESPONSE.format(
        output="hi"
    )
    assert (
        text == "\n<tool_response>\n1024\n</tool_response>\n<tool_response>\nhi\n</tool_response>\n"
    )
    ids = responses.ids("", results)
    # The built-in tokenizer has printable ASCII only: a newline is its <unk>.
    assert tokenizer.decode(ids) == text.replace("\n", "<unk>")
