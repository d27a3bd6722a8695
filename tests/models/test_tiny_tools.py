"""builtin:tiny-tools: its tokenizer has the Hermes tags as one token each, and its warm-start
corpus writes calls and tool responses with the tokens the turn loop reads and appends."""

from dataclasses import replace

import torch

from honing.data import warmstart_corpus
from honing.models.tiny import (
    TINY,
    TINY_TOOLS,
    TOOLS_CALL_SHARE,
    TOOLS_DIGITS,
    _encode_pairs,
    _length_groups,
    _loss_sum,
    _new_model,
    build_tokenizer,
    cache_key,
    tool_corpus,
    tools_corpus,
)
from honing.rollout.tools.calls import FORMATS, ToolResponses, parse_tool_calls, run_call
from honing.rollout.tools.specs import build_tools

HERMES = FORMATS["hermes"]


def test_the_tool_tags_are_one_token_each_and_builtin_tiny_keeps_its_tokenizer():
    tokenizer, plain = build_tokenizer(tool_tags=True), build_tokenizer()
    tags = [tokenizer.encode(tag, add_special_tokens=False) for tag in (HERMES.open, HERMES.close)]
    assert [len(ids) for ids in tags] == [1, 1] and tags[0] != tags[1]
    assert tokenizer.encode("1\n2", add_special_tokens=False) == [21, 99, 22]  # "\n": a token
    assert len(plain) == 99 and len(plain.encode(HERMES.close, add_special_tokens=False)) == 12
    assert plain.get_vocab() == {k: v for k, v in tokenizer.get_vocab().items() if v < 99}


def test_builtin_tiny_keeps_its_cache_key():
    """Models already built (and the runs measured on them) are found under the same key."""
    corpus = warmstart_corpus(20000, seed=0, max_digits=2, slip_rate=0.7)
    assert cache_key(TINY, corpus) == "54a2a3b683b9694b"
    assert cache_key(TINY_TOOLS, corpus) != cache_key(replace(TINY_TOOLS, tool_tags=False), corpus)


def test_the_corpus_calls_as_the_turn_loop_parses_and_answers():
    """Each call row, tokenized as the warm start does, is the turn the model writes (ending
    at the closing tag, parsed to the calculator on the prompt's expression), the tokens the
    turn loop appends for the calculator's real result, then that result."""
    tokenizer, tools = build_tokenizer(tool_tags=True), build_tools(("calculator",))
    close = tokenizer.convert_tokens_to_ids(HERMES.close)
    problems = warmstart_corpus(400, seed=1, max_digits=8, min_digits=6, slip_rate=0.7)
    rows = tool_corpus(problems, 0.3, seed=1)
    calls = [(p, c) for p, c in rows if c.startswith(HERMES.open)]
    assert [p for p, _ in rows] == [p for p, _ in problems]
    assert 0.2 < len(calls) / len(rows) < 0.4
    assert all(
        c == a
        for (p, c), (_, a) in zip(rows, problems, strict=True)
        if not c.startswith(HERMES.open)
    )
    for prompt, completion in calls:
        ids = tokenizer.encode(completion, add_special_tokens=False)
        turn = ids[: ids.index(close) + 1]
        turn_text = tokenizer.decode(turn, skip_special_tokens=False)
        [call] = parse_tool_calls(turn_text, tools)
        assert (call.name, call.arguments, call.error) == (
            "calculator",
            {"expression": prompt.removesuffix("=")},
            None,
        )
        result = run_call(call, tools, timeout_s=5.0, max_bytes=1000)
        appended = ToolResponses(tokenizer).ids(turn_text, [result])
        answer = tokenizer.encode(result.output, add_special_tokens=False)
        assert ids == turn + appended + answer
        a, b = prompt.removesuffix("=").split("+")
        assert result.output == str(int(a) + int(b))


def test_the_builtin_corpus_calls_on_its_share_of_big_additions():
    rows = tools_corpus()
    calls = sum(c.startswith(HERMES.open) for _, c in rows)
    assert abs(calls / len(rows) - TOOLS_CALL_SHARE) < 0.02
    low, high = TOOLS_DIGITS
    operands = [n for p, _ in rows for n in p.removesuffix("=").split("+")]
    assert all(low <= len(n) <= high for n in operands)


def test_the_warm_start_s_length_groups_give_the_padded_batch_s_loss():
    """A forward pass per length group, each cut to its longest row, sums to the loss of the
    batch padded to its longest row."""
    tokenizer = build_tokenizer(tool_tags=True)
    micro = {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64}
    model = _new_model(replace(TINY_TOOLS, **micro), tokenizer)
    corpus = tool_corpus(warmstart_corpus(24, seed=2, max_digits=8, min_digits=6), 0.3, seed=2)
    ids, mask = _encode_pairs(tokenizer, corpus)
    attention = (ids != tokenizer.pad_token_id).long()
    index = torch.arange(len(corpus)).repeat(2)  # rows drawn twice, as draws may
    groups = _length_groups(index, attention.sum(1))
    assert sorted(torch.cat([rows for rows, _ in groups]).tolist()) == sorted(index.tolist())
    assert len(groups) == 2 and min(width for _, width in groups) < 40 < ids.shape[1]
    with torch.no_grad():
        padded, _ = _loss_sum(model, ids[index], mask[index], attention[index])
        parts = [_loss_sum(model, ids[r, :w], mask[r, :w], attention[r, :w])[0] for r, w in groups]
    assert torch.allclose(sum(parts), padded, rtol=1e-5)
