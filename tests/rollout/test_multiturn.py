"""Multi-turn rollouts with tools (rollout/tools/turns.py): the turn loop over a scripted engine
(what the model says is fixed, so the sequences can be written out by hand), the masks and
logprobs the trainer gets, token exactness, a slow tool that does not hold the others, calls
no tokenizer or JSON reader takes, and tools that hang.

The tokenizer is the built-in one (one token per character) with the Hermes tags added as
special tokens, as chat models with tools have them."""

import threading
import time

import pytest
import torch

from honing.errors import ConfigError
from honing.models.loading import load_tokenizer
from honing.rollout.base import GenerationRequest, Holding, RolloutEngine, SamplingParams
from honing.rollout.tools.calls import FALLBACK_RESPONSE, MAX_TOOL_THREADS
from honing.rollout.tools.specs import Tool, ToolSettings, build_tools, function_schema
from honing.rollout.tools.turns import ToolEngine
from honing.trainer.batch import collate
from honing.types import Rollout

LOGPROB = -0.5  # every scripted token's behaviour logprob


@pytest.fixture(scope="module")
def tokenizer(tagged_tokenizer):
    return tagged_tokenizer


class Scripted(RolloutEngine):
    """Says ``script[prompt_id][k]`` (token ids) on the k-th request of that prompt, cut at a
    stop id as an engine cuts it; records each request's ids and when it came."""

    def __init__(self, script: dict[str, list[list[int]]], stop: int):
        super().__init__(Holding.COPY)
        self.script, self.stop = script, stop
        self.seen: dict[str, list[list[int]]] = {p: [] for p in script}
        self.calls: list[tuple[float, list[str]]] = []

    def generate(self, requests, params):
        self.calls.append((time.monotonic(), [r.prompt_id for r in requests]))
        out = []
        for r in requests:
            turn = self.script[r.prompt_id][len(self.seen[r.prompt_id])]
            self.seen[r.prompt_id].append(list(r.prompt_ids))
            stops = {self.stop, *params.stop_ids}
            end = next((i + 1 for i, t in enumerate(turn) if t in stops), len(turn))
            ids = turn[: min(end, params.max_new_tokens)]
            reason = "stop" if ids and ids[-1] in stops else "length"
            experts = torch.arange(len(r.prompt_ids) + len(ids) - 1)[:, None, None]
            out.append(
                Rollout(
                    r.prompt_id,
                    r.group_index,
                    list(r.prompt_ids),
                    ids,
                    [LOGPROB] * len(ids),
                    reason,
                    self.weight_version,
                    "",
                    routed_experts=experts,  # the token's position, to see which call it is
                )
            )
        return out

    def load_weights(self, version, weights=None):
        self.weight_version = version

    def detached_copy(self):
        return self


def call(tokenizer, expression: str, spelled: bool = False) -> list[int]:
    """A turn that calls the calculator: the open tag (as one special token, or ``spelled``
    out a character at a time), the JSON, the closing tag."""
    body = '{"name": "calculator", "arguments": {"expression": "' + expression + '"}}'
    opener = tokenizer.encode("<tool_call>", add_special_tokens=False)
    if spelled:
        opener = [tokenizer.convert_tokens_to_ids(c) for c in "<tool_call>"]
    close = tokenizer.convert_tokens_to_ids("</tool_call>")
    return opener + tokenizer.encode(body, add_special_tokens=False) + [close]


def words(tokenizer, text: str, end: bool = True) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False) + (
        [tokenizer.eos_token_id] if end else []
    )


def tool_engine(
    tokenizer, script, tools=("calculator",), **settings
) -> tuple[ToolEngine, Scripted]:
    inner = Scripted(script, tokenizer.eos_token_id)
    s = ToolSettings(tools=tuple(tools), **settings)
    return ToolEngine(inner, tokenizer, s, build_tools(s.tools)), inner


PARAMS = SamplingParams(n=1, max_new_tokens=200, max_seq_len=400)


def test_a_two_turn_sample_s_tokens_mask_and_logprobs(tokenizer):
    """Turn 1 calls the calculator, turn 2 answers: the response is turn 1, the tool's
    response, turn 2; the tool's tokens are masked out of the loss with logprob 0, the
    model's carry the logprobs they were sampled with; the second call's prompt is the first's
    and every token since, exactly."""
    prompt = words(tokenizer, "12345678+87654321=", end=False)
    first, answer = call(tokenizer, "12345678+87654321"), words(tokenizer, "99999999")
    engine, inner = tool_engine(tokenizer, {"p": [first, answer]})
    [rollout] = engine.generate([GenerationRequest("p", prompt, 0)], PARAMS)
    tool = tokenizer.encode(
        "\n" + FALLBACK_RESPONSE.format(output="99999999"), add_special_tokens=False
    )
    assert rollout.response_ids == first + tool + answer
    assert rollout.tool_spans == [(len(first), len(tool))]
    assert rollout.behaviour_logprobs == [LOGPROB] * len(first) + [0.0] * len(tool) + [
        LOGPROB
    ] * len(answer)
    assert rollout.finish_reason == "stop" and rollout.turns == 2
    assert [c["name"] for c in rollout.tool_calls] == ["calculator"]
    assert not rollout.tool_calls[0]["error"]
    assert inner.seen["p"] == [prompt, prompt + first + tool]  # token in, token out
    batch = collate([rollout], tokenizer.pad_token_id, torch.device("cpu"))
    expected = [1.0] * len(first) + [0.0] * len(tool) + [1.0] * len(answer)
    assert batch.response_mask[0].tolist() == expected
    assert batch.response_real[0].tolist() == [1] * len(rollout.response_ids)
    assert batch.responses[0].tolist() == rollout.response_ids


def test_the_trained_sequence_is_the_tokens_the_engine_saw_not_its_text_again(tokenizer):
    """The model spells the open tag a character at a time: its text reads as a call, and
    encoding that text again would give the one special token instead. The response keeps
    the characters the model sampled, and the next turn's prompt is built on them."""
    prompt = words(tokenizer, "2+2=", end=False)
    spelled = call(tokenizer, "2+2", spelled=True)
    engine, inner = tool_engine(tokenizer, {"p": [spelled, words(tokenizer, "4")]})
    [rollout] = engine.generate([GenerationRequest("p", prompt, 0)], PARAMS)
    start, count = rollout.tool_spans[0]
    assert rollout.response_ids[:start] == spelled
    text = tokenizer.decode(spelled, skip_special_tokens=False)
    assert tokenizer.encode(text, add_special_tokens=False) != spelled  # text would drift
    assert inner.seen["p"][1] == prompt + rollout.response_ids[: start + count]


def test_a_slow_tool_does_not_hold_the_other_samples(tokenizer, tmp_path):
    """One sample's call sleeps 2 s; three others call a fast tool: their answers are
    generated (a second engine call) before the slow call returns, and the slow sample
    finishes after it."""
    tool_file = tmp_path / "clock.py"
    tool_file.write_text(
        "import time\n\ndef clock(seconds: float) -> str:\n"
        '    """Waits ``seconds``.\n\n    Args:\n        seconds: how long.\n    """\n'
        "    time.sleep(seconds)\n    return 'done'\n"
    )

    def waits(seconds):
        body = '{"name": "clock", "arguments": {"seconds": ' + str(seconds) + "}}"
        open_, close = (tokenizer.convert_tokens_to_ids(t) for t in ("<tool_call>", "</tool_call>"))
        return [open_, *tokenizer.encode(body, add_special_tokens=False), close]

    script = {f"p{i}": [waits(2.0 if i == 0 else 0.0), words(tokenizer, "ok")] for i in range(4)}
    engine, inner = tool_engine(
        tokenizer, script, tools=(f"{tool_file}:clock",), tool_timeout_s=5.0
    )
    requests = [
        GenerationRequest(p, words(tokenizer, "go", end=False), i) for i, p in enumerate(script)
    ]
    started = time.monotonic()
    rollouts = engine.generate(requests, PARAMS)
    assert all(r.finish_reason == "stop" and r.turns == 2 for r in rollouts)
    second = [(t - started, ids) for t, ids in inner.calls[1:]]
    fast = next(t for t, ids in second if "p1" in ids)
    slow = next(t for t, ids in second if "p0" in ids)
    assert fast < 1.0 <= 2.0 <= slow  # the fast ones went on while the slow call ran
    assert "p0" not in next(ids for _, ids in second if "p1" in ids)


def test_limits_end_a_sample_on_a_token_the_model_sampled(tokenizer):
    """At max_turns the last turn's call is not run; a tool response that does not fit the
    token budget is not appended; an unknown tool is an error the model reads."""
    prompt = words(tokenizer, "1+1=", end=False)
    again = call(tokenizer, "1+1")
    engine, _ = tool_engine(tokenizer, {"p": [again, again, again]}, max_turns=2)
    [capped] = engine.generate([GenerationRequest("p", prompt, 0)], PARAMS)
    assert capped.turns == 2 and capped.finish_reason == "length" and len(capped.tool_calls) == 1
    assert capped.response_ids[-1] == tokenizer.convert_tokens_to_ids("</tool_call>")
    engine, _ = tool_engine(tokenizer, {"p": [again, again]})
    tight = SamplingParams(n=1, max_new_tokens=len(again) + 5, max_seq_len=400)
    [cut] = engine.generate([GenerationRequest("p", prompt, 0)], tight)
    assert cut.response_ids == again and cut.tool_spans == [] and cut.finish_reason == "length"
    unknown = call(tokenizer, "1").copy()
    text = tokenizer.decode(unknown, skip_special_tokens=False).replace("calculator", "abacus")
    bad = tokenizer.encode(text, add_special_tokens=False)
    engine, _ = tool_engine(tokenizer, {"p": [bad, words(tokenizer, "2")]})
    [erred] = engine.generate([GenerationRequest("p", prompt, 0)], PARAMS)
    assert erred.tool_calls[0]["error"] and erred.finish_reason == "stop"
    metrics, _ = engine.take_report()
    assert metrics["tool/errors"] == 1 and metrics["tool/calls_per_sample"] == 1


def test_a_closing_tag_that_is_not_one_token_is_refused(micro_model_dir):
    plain = load_tokenizer(micro_model_dir)  # no tags added: </tool_call> is 12 characters
    with pytest.raises(ConfigError, match="a turn ends at one token"):
        ToolEngine(Scripted({}, plain.eos_token_id), plain, ToolSettings(), {})


def test_n_samples_of_a_prompt_go_their_own_ways(tokenizer):
    """n=2: each sample is its own sequence of turns (the scripted engine answers the
    prompt's requests in order: the first sample calls, the second answers at once)."""
    prompt = words(tokenizer, "3+4=", end=False)
    engine, _ = tool_engine(
        tokenizer, {"p": [call(tokenizer, "3+4"), words(tokenizer, "7"), words(tokenizer, "7")]}
    )
    rollouts = engine.generate(
        [GenerationRequest("p", prompt, 0)],
        SamplingParams(n=2, max_new_tokens=200, max_seq_len=400),
    )
    assert sorted(r.turns for r in rollouts) == [1, 2]
    assert all(r.group_index == 0 for r in rollouts)


def test_concurrent_samples_of_one_call_are_independent(tokenizer):
    """A thread-safety smoke: two generate calls on two engines at once."""
    results = []

    def run(name):
        engine, _ = tool_engine(tokenizer, {name: [call(tokenizer, "6*7"), words(tokenizer, "42")]})
        results.append(
            engine.generate(
                [GenerationRequest(name, words(tokenizer, "6*7=", end=False), 0)], PARAMS
            )
        )

    threads = [threading.Thread(target=run, args=(f"q{i}",)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 2 and all(r[0].turns == 2 for r in results)


def test_a_multi_turn_sample_s_routed_experts_are_its_last_turn_s(tokenizer):
    """Routing replay (R3): the last turn's call ran the prompt and every earlier token, tool
    responses included, so its experts cover the whole sequence but its last token."""
    prompt = words(tokenizer, "5+5=", end=False)
    engine, _ = tool_engine(tokenizer, {"p": [call(tokenizer, "5+5"), words(tokenizer, "10")]})
    [rollout] = engine.generate([GenerationRequest("p", prompt, 0)], PARAMS)
    length = len(prompt) + len(rollout.response_ids) - 1
    assert rollout.routed_experts[:, 0, 0].tolist() == list(range(length))


def test_calls_that_break_json_or_the_tokenizer_are_error_results(tokenizer):
    """Calls nested past the recursion limit, with a 4,301-digit integer, an argument named
    by a lone surrogate (JSON ``\\ud800``), and a tool whose output is a lone surrogate: each
    sample gets its error or output back as text the tokenizer takes, and answers."""
    tags = [tokenizer.convert_tokens_to_ids(t) for t in ("<tool_call>", "</tool_call>")]

    def turn(body: str) -> list[int]:
        return [tags[0], *tokenizer.encode(body, add_special_tokens=False), tags[1]]

    bodies = {
        "deep": "[" * 1000,
        "digits": '{"name": "calculator", "arguments": {"expression": ' + "7" * 4301 + "}}",
        "key": '{"name": "calculator", "arguments": {"expression": "1", "\\ud800": 1}}',
        "output": '{"name": "lone", "arguments": {}}',
    }
    script = {p: [turn(body), words(tokenizer, "ok")] for p, body in bodies.items()}
    lone = Tool(
        "lone", function_schema("lone", "A lone surrogate.", {}, []), lambda a, **_: "\ud800"
    )
    tools = build_tools(["calculator"]) | {"lone": lone}
    inner = Scripted(script, tokenizer.eos_token_id)
    engine = ToolEngine(inner, tokenizer, ToolSettings(tools=("calculator",)), tools)
    requests = [GenerationRequest(p, words(tokenizer, "go", end=False), 0) for p in script]
    params = SamplingParams(n=1, max_new_tokens=6000, max_seq_len=6100)
    rollouts = {r.prompt_id: r for r in engine.generate(requests, params)}
    assert all(r.finish_reason == "stop" and r.turns == 2 for r in rollouts.values())
    assert [rollouts[p].tool_calls[0]["error"] for p in bodies] == [True, True, True, False]

    def response(prompt_id: str) -> str:
        start, count = rollouts[prompt_id].tool_spans[0]
        return tokenizer.decode(rollouts[prompt_id].response_ids[start : start + count])

    assert "error: malformed tool call: " in response("deep")  # too deep, or unclosed
    assert "a number with too many digits" in response("digits")
    assert "unknown argument(s) \\ud800" in response("key")
    assert "<tool_response><unk>\\ud800<unk></tool_response>" in response("output")


def test_hung_tools_keep_a_bounded_number_of_threads_and_are_counted(tokenizer):
    """200 samples each call a tool that hangs: every call comes back as a timeout, at most
    MAX_TOOL_THREADS threads are kept for them, and the metrics count the timeouts and the
    threads held."""
    release = threading.Event()
    hang = Tool("hang", function_schema("hang", "Hangs.", {}, []), lambda a, **_: release.wait())
    body = '{"name": "hang", "arguments": {}}'
    tags = [tokenizer.convert_tokens_to_ids(t) for t in ("<tool_call>", "</tool_call>")]
    turn = [tags[0], *tokenizer.encode(body, add_special_tokens=False), tags[1]]
    script = {f"p{i}": [turn, words(tokenizer, "ok")] for i in range(200)}
    inner = Scripted(script, tokenizer.eos_token_id)
    settings = ToolSettings(tools=("hang",), tool_timeout_s=0.05)
    engine = ToolEngine(inner, tokenizer, settings, {"hang": hang})
    requests = [GenerationRequest(p, words(tokenizer, "go", end=False), 0) for p in script]
    before = threading.active_count()
    try:
        rollouts = engine.generate(requests, PARAMS)
        assert threading.active_count() - before <= MAX_TOOL_THREADS
        metrics, _ = engine.take_report()
    finally:
        release.set()
    assert all(r.finish_reason == "stop" and r.tool_calls[0]["timed_out"] for r in rollouts)
    assert metrics["tool/calls"] == metrics["tool/timeouts"] == 200
    assert 1 <= metrics["tool/hung_threads"] <= MAX_TOOL_THREADS
