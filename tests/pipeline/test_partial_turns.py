"""Partial rollouts of multi-turn samples with tools, and of a mixture-of-experts policy's
routed experts (R3): a sample continued chunk by chunk is the sample one call makes, its tool
responses, calls and turns included (a turn cut at a chunk goes on in the next call, a tool
call split across two chunks still runs), and its routed experts are stitched, each row from
the chunk that sampled the token after it."""

from types import SimpleNamespace

import pytest
import torch

from honing.pipeline.partial import PartialPool
from honing.rollout.base import GenerationRequest, Holding, RolloutEngine, SamplingParams
from honing.rollout.tools.specs import ToolSettings, build_tools
from honing.rollout.tools.turns import ToolEngine
from honing.types import Prompt, Rollout
from tests.rollout.test_multiturn import LOGPROB, Scripted, call, words

CALL = 1000  # a routed-expert row's value: its position + CALL * the engine call that ran it
TOOLS = ToolSettings(tools=("calculator",))


class Transcript(RolloutEngine):
    """A model that says the model's part of ``response`` (a whole multi-turn response, tool
    responses in ``tools`` spans) from wherever its request's tokens have got to, cut at a
    stop id or its token budget; its routed experts say each row's position and call."""

    def __init__(self, prompt: list[int], response: list[int], tools: list[tuple[int, int]], stop):
        super().__init__(Holding.COPY)
        self.prompt, self.response, self.stop = prompt, response, stop
        self.said = [True] * len(response)
        for start, count in tools:
            self.said[start : start + count] = [False] * count
        self.calls = 0

    def generate(self, requests, params):
        out = []
        for r in requests:
            at = len(r.prompt_ids) - len(self.prompt)
            ids = []
            while at < len(self.response) and self.said[at] and len(ids) < params.max_new_tokens:
                ids.append(self.response[at])
                at += 1
                if ids[-1] in {self.stop, *params.stop_ids}:
                    break
            stopped = bool(ids) and ids[-1] in {self.stop, *params.stop_ids}
            rows = torch.arange(len(r.prompt_ids) + len(ids) - 1) + CALL * self.calls
            out.append(
                Rollout(
                    r.prompt_id,
                    r.group_index,
                    list(r.prompt_ids),
                    ids,
                    [LOGPROB] * len(ids),
                    "stop" if stopped else "length",
                    self.weight_version,
                    "",
                    routed_experts=rows[:, None, None],
                )
            )
        self.calls += 1
        return out

    def load_weights(self, version, weights=None):
        self.weight_version = version

    def detached_copy(self):
        return self


@pytest.mark.parametrize("chunk", [3, 7, 40])
def test_a_tool_sample_continued_by_chunks_is_the_sample_one_call_makes(tagged_tokenizer, chunk):
    tokenizer = tagged_tokenizer
    prompt = words(tokenizer, "12+30=", end=False)
    turns = [call(tokenizer, "12+30"), call(tokenizer, "42*2"), words(tokenizer, "42")]
    settings = ToolSettings(tools=("calculator",))
    whole_engine = ToolEngine(
        Scripted({"p": turns}, tokenizer.eos_token_id),
        tokenizer,
        settings,
        build_tools(("calculator",)),
    )
    params = SamplingParams(n=1, max_new_tokens=300, max_seq_len=400)
    [whole] = whole_engine.generate([GenerationRequest("p", prompt, 0)], params)
    assert whole.turns == 3 and len(whole.tool_calls) == 2  # the script ran as written

    inner = Transcript(prompt, whole.response_ids, whole.tool_spans, tokenizer.eos_token_id)
    engine = ToolEngine(inner, tokenizer, TOOLS, build_tools(TOOLS.tools))
    parts = SimpleNamespace(
        engine=engine,
        tokenizer=tokenizer,
        prompt_ids={"p": prompt},
        train_sampling=params,
    )
    pool = PartialPool(parts, group_size=1, batch_size=1, chunk_tokens=chunk, max_staleness=2)
    pool.add([Prompt("p", "12+30=", "42")])
    while pool.ready() < 1:
        pool.chunk(seed=0)
    [rollout] = pool.rollouts(pool.take(), 0)
    assert pool.calls > 1 or chunk >= len(whole.response_ids)
    assert rollout.response_ids == whole.response_ids
    assert rollout.behaviour_logprobs == whole.behaviour_logprobs
    assert rollout.tool_spans == whole.tool_spans
    assert [c["name"] for c in rollout.tool_calls] == ["calculator", "calculator"]
    assert not any(c["error"] for c in rollout.tool_calls)
    assert rollout.turns == 3 and rollout.finish_reason == "stop"
    # R3: a row per input token, each from the call that sampled the token after it (the
    # prompt's from the first call, which sampled the first response token)
    rows = rollout.routed_experts[:, 0, 0]
    positions = torch.arange(len(prompt) + len(rollout.response_ids) - 1)
    assert torch.equal(rows % CALL, positions)
    made_by = rows // CALL
    assert bool((made_by[: len(prompt)] == 0).all()) and bool((made_by.diff() >= 0).all())
    assert int(made_by[-1]) == inner.calls - 1 or chunk >= len(whole.response_ids)
