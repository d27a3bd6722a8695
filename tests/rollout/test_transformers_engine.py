"""The in-process engine's sampling loop against full forward passes of the same model.

The engine samples with a KV cache over left-padded prompts; the trainer later scores the same
tokens with one unpadded-by-row forward pass. These tests check that both see the same
distribution, token for token, so that the behaviour logprobs carried by a rollout are exact.
"""

import copy
import math
from dataclasses import replace

import pytest
import torch

from honing.models.loading import load_causal_lm, load_tokenizer
from honing.rollout.base import GenerationRequest, SamplingParams
from honing.rollout.native.engine import TransformersEngine
from honing.rollout.native.sampling import filter_logits
from tests.rollout.continuing import continued

CPU = torch.device("cpu")
# Prompts of different lengths in one batch, so most rows are left-padded.
PROMPTS = ["7+5=", "13+45=", "a", "99+9=", "+"]


@pytest.fixture(scope="module")
def tokenizer(micro_model_dir):
    return load_tokenizer(micro_model_dir)


@pytest.fixture(scope="module")
def model(micro_model_dir, tokenizer):
    return load_causal_lm(micro_model_dir, tokenizer, dtype="float32", device=CPU)


@pytest.fixture(params=[True, False], ids=["fast", "hf"])
def engine(request, model, tokenizer):
    """Every engine test runs on both forward paths: the fast decoder and the model's own."""
    engine = TransformersEngine(model, tokenizer, device=CPU, fast_decode=request.param)
    assert engine.fast_decode == request.param
    return engine


def requests_for(tokenizer, prompts=PROMPTS) -> list[GenerationRequest]:
    return [
        GenerationRequest(f"p{i}", tokenizer.encode(text), group_index=i)
        for i, text in enumerate(prompts)
    ]


@torch.no_grad()
def full_forward_logprobs(model, prompt_ids, response_ids, temperature=1.0) -> torch.Tensor:
    """Log-probability of each response token from one forward pass of prompt + response."""
    ids = torch.tensor([prompt_ids + response_ids])
    logits = model(input_ids=ids).logits[0].float()  # [P + R, V]
    # Position P + r - 1 predicts response token r.
    start = len(prompt_ids) - 1
    logp = (logits[start : start + len(response_ids)] / temperature).log_softmax(-1)  # [R, V]
    return logp.gather(-1, torch.tensor(response_ids)[:, None]).squeeze(-1)


def assert_behaviour_logprobs_match(model, rollouts, temperature):
    for rollout in rollouts:
        expected = full_forward_logprobs(
            model, rollout.prompt_ids, rollout.response_ids, temperature
        )
        actual = torch.tensor(rollout.behaviour_logprobs)
        assert actual.shape == expected.shape
        torch.testing.assert_close(actual, expected, atol=1e-4, rtol=0)


def test_behaviour_logprobs_equal_full_forward(engine, model, tokenizer):
    params = SamplingParams(n=4, max_new_tokens=8, temperature=1.0, seed=1)
    rollouts = engine.generate(requests_for(tokenizer), params)
    assert len(rollouts) == len(PROMPTS) * 4
    # Both kinds of rows occur: ones that stopped early (later columns are padding) and ones
    # that ran to the limit, and at least one response is long enough to exercise the cache.
    assert {r.finish_reason for r in rollouts} == {"stop", "length"}
    assert max(len(r.response_ids) for r in rollouts) == 8
    assert_behaviour_logprobs_match(model, rollouts, temperature=1.0)


def test_behaviour_logprobs_follow_the_temperature(engine, model, tokenizer):
    params = SamplingParams(n=3, max_new_tokens=6, temperature=0.7, seed=2)
    rollouts = engine.generate(requests_for(tokenizer), params)
    assert_behaviour_logprobs_match(model, rollouts, temperature=0.7)
    # ... and not the untempered distribution.
    rollout = max(rollouts, key=lambda r: len(r.response_ids))
    untempered = full_forward_logprobs(model, rollout.prompt_ids, rollout.response_ids, 1.0)
    assert not torch.allclose(torch.tensor(rollout.behaviour_logprobs), untempered, atol=1e-3)


def test_positions_count_from_each_rows_first_real_token(model, tokenizer):
    # Llama's rotary embeddings only see relative positions, so the logprob tests above cannot
    # tell an offset; models with absolute position embeddings can. Record what is passed to
    # the model's own forward (the fast path gets the same positions from the same loop).
    engine = TransformersEngine(model, tokenizer, device=CPU, fast_decode=False)
    calls = []

    def record(module, args, kwargs):
        calls.append((kwargs["position_ids"].tolist(), kwargs["attention_mask"].tolist()))

    handle = model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        requests = requests_for(tokenizer, ["12+3=", "a"])
        engine.generate(requests, SamplingParams(n=1, max_new_tokens=3, greedy=True))
    finally:
        handle.remove()
    # Prefill: "a" is left-padded by 4; then one forward per new token while any row runs.
    assert calls == [
        ([[0, 1, 2, 3, 4], [0, 0, 0, 0, 0]], [[1, 1, 1, 1, 1], [0, 0, 0, 0, 1]]),
        ([[5], [1]], [[1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1]]),
        ([[6], [2]], [[1, 1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1, 1]]),
    ]


@torch.no_grad()
def argmax_continuation(model, prompt_ids, max_new_tokens, eos_id) -> list[int]:
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        token = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
        ids.append(token)
        if token == eos_id:
            break
    return ids[len(prompt_ids) :]


def test_greedy_is_the_argmax_continuation(engine, model, tokenizer):
    params = SamplingParams(n=1, max_new_tokens=6, greedy=True, temperature=0.3, seed=5)
    requests = requests_for(tokenizer)
    first = engine.generate(requests, params)
    again = engine.generate(requests, SamplingParams(n=1, max_new_tokens=6, greedy=True, seed=9))
    assert [r.response_ids for r in first] == [r.response_ids for r in again]
    for request, rollout in zip(requests, first, strict=True):
        expected = argmax_continuation(model, request.prompt_ids, 6, tokenizer.eos_token_id)
        assert rollout.response_ids == expected
    # Greedy ignores the temperature: its logprobs are those of the untempered model.
    assert_behaviour_logprobs_match(model, first, temperature=1.0)


def test_same_seed_same_rollouts_other_seed_other_rollouts(engine, tokenizer):
    requests = requests_for(tokenizer)

    def sample(seed):
        rollouts = engine.generate(requests, SamplingParams(n=2, max_new_tokens=8, seed=seed))
        return [(r.response_ids, r.behaviour_logprobs, r.finish_reason) for r in rollouts]

    first = sample(11)
    torch.manual_seed(123)  # the global RNG must not matter
    assert sample(11) == first
    assert sample(12) != first


def test_finish_reasons(engine, tokenizer):
    eos = tokenizer.eos_token_id
    requests = requests_for(tokenizer)
    for params in (
        SamplingParams(n=4, max_new_tokens=1, seed=3),
        SamplingParams(n=1, max_new_tokens=1, greedy=True),
        SamplingParams(n=4, max_new_tokens=8, seed=4),
    ):
        rollouts = engine.generate(requests, params)
        for rollout in rollouts:
            assert 1 <= len(rollout.response_ids) <= params.max_new_tokens
            assert len(rollout.behaviour_logprobs) == len(rollout.response_ids)
            # EOS can only be the last token, and it is there exactly when the reason is stop.
            assert eos not in rollout.response_ids[:-1]
            assert (rollout.response_ids[-1] == eos) == (rollout.finish_reason == "stop")
            if rollout.finish_reason == "length":
                assert len(rollout.response_ids) == params.max_new_tokens
    # Both branches are taken: on this model the greedy first token is EOS after an arithmetic
    # prompt ("7+5=") and a character after a stray one ("a").
    greedy = engine.generate(requests, SamplingParams(n=1, max_new_tokens=1, greedy=True))
    assert {r.finish_reason for r in greedy} == {"stop", "length"}
    assert all(r.response_ids == [eos] for r in greedy if r.finish_reason == "stop")


def test_max_seq_len_caps_the_response(engine, tokenizer):
    request = GenerationRequest("long", tokenizer.encode("hello"), 0)  # 5 tokens, never stops
    params = SamplingParams(n=1, max_new_tokens=8, max_seq_len=7, greedy=True)
    (rollout,) = engine.generate([request], params)
    assert len(rollout.response_ids) == 2
    assert rollout.finish_reason == "length"


def test_prompt_longer_than_max_seq_len_names_the_prompt(engine, tokenizer):
    requests = requests_for(tokenizer, ["1+1=", "12345+67890="])
    requests[1] = GenerationRequest("problem-17", requests[1].prompt_ids, 1)
    with pytest.raises(ValueError, match="prompt problem-17 has 12 tokens; rollout.max_seq_len"):
        engine.generate(requests, SamplingParams(max_seq_len=12))


def test_n_rollouts_per_request_grouped_in_request_order(model, tokenizer):
    # generation_batch=4 splits the 9 sequences into chunks of 4, 4, 1: order must survive.
    engine = TransformersEngine(model, tokenizer, device=CPU, generation_batch=4)
    engine.load_weights(7)
    requests = requests_for(tokenizer, ["1+2=", "a", "34+5="])
    rollouts = engine.generate(requests, SamplingParams(n=3, max_new_tokens=3, seed=0))
    assert [r.prompt_id for r in rollouts] == ["p0"] * 3 + ["p1"] * 3 + ["p2"] * 3
    assert [r.group_index for r in rollouts] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert [r.prompt_ids for r in rollouts] == [q.prompt_ids for q in requests for _ in range(3)]
    assert {r.weight_version for r in rollouts} == {7}
    assert_behaviour_logprobs_match(model, rollouts, temperature=1.0)


def test_engine_rejects_pad_equal_to_eos(model, tokenizer):
    class SamePadEos:
        pad_token_id = eos_token_id = tokenizer.eos_token_id

    with pytest.raises(ValueError, match="pad token distinct from eos"):
        TransformersEngine(model, SamePadEos(), device=CPU)


# --- filter_logits ---------------------------------------------------------------------------


def test_top_k_keeps_exactly_k():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.5], [0.0, -1.0, 4.0, 5.0]])
    kept = filter_logits(logits, top_k=2, top_p=1.0)
    expected = torch.tensor([[-math.inf, 3.0, 2.0, -math.inf], [-math.inf, -math.inf, 4.0, 5.0]])
    assert torch.equal(kept, expected)
    assert torch.equal(filter_logits(logits, top_k=0, top_p=1.0), logits)  # 0 = off
    assert torch.equal(filter_logits(logits, top_k=4, top_p=1.0), logits)


# Probabilities 0.1, 0.5, 0.15, 0.25: sorted 0.5, 0.25, 0.15, 0.1 with cumulative mass before
# each of 0, 0.5, 0.75, 0.9. The nucleus is the shortest prefix whose mass reaches top_p.
NUCLEUS_LOGITS = torch.tensor([[0.1, 0.5, 0.15, 0.25]]).log()


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [
        (0.4, [False, True, False, False]),  # 0.5 alone reaches 0.4
        (0.6, [False, True, False, True]),  # 0.5 + 0.25 = 0.75
        (0.8, [False, True, True, True]),  # 0.5 + 0.25 + 0.15 = 0.9
        (0.95, [True, True, True, True]),
    ],
)
def test_top_p_keeps_the_smallest_nucleus(top_p, kept):
    filtered = filter_logits(NUCLEUS_LOGITS, top_k=0, top_p=top_p)
    assert torch.isfinite(filtered[0]).tolist() == kept
    # Kept logits are unchanged (renormalisation happens in the softmax that follows).
    mask = torch.tensor([kept])
    assert torch.equal(filtered[mask], NUCLEUS_LOGITS[mask])


def test_top_p_applies_to_the_top_k_distribution():
    # Without top-k, 0.5 < 0.54 so the nucleus needs 0.25 too. After top_k=3 drops 0.1 the
    # renormalised mass of the first token is 0.5 / 0.9 = 0.556 >= 0.54: it is alone.
    assert torch.isfinite(filter_logits(NUCLEUS_LOGITS, 0, 0.54)).sum() == 2
    assert torch.isfinite(filter_logits(NUCLEUS_LOGITS, 3, 0.54)).tolist() == [
        [False, True, False, False]
    ]


def test_sampling_respects_top_k(engine, model, tokenizer):
    rollouts = engine.generate(
        requests_for(tokenizer), SamplingParams(n=4, max_new_tokens=4, top_k=2, seed=6)
    )
    for rollout in rollouts:
        ids = rollout.prompt_ids + rollout.response_ids
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0]
        start = len(rollout.prompt_ids) - 1
        for r, token in enumerate(rollout.response_ids):
            top2 = logits[start + r].topk(2).indices.tolist()
            assert token in top2
            # The behaviour logprob is that of the 2-token distribution, not the full one.
            two = logits[start + r, top2].log_softmax(-1)
            expected = two[top2.index(token)]
            assert rollout.behaviour_logprobs[r] == pytest.approx(float(expected), abs=1e-4)


def test_stops_on_generation_config_eos_too(micro_model_dir):
    """Chat models end a turn with a token that is not the tokenizer's EOS (e.g. <|im_end|>)."""
    from honing.models.loading import load_causal_lm, load_tokenizer
    from honing.rollout.native.engine import stop_token_ids

    tokenizer = load_tokenizer(micro_model_dir)
    model = load_causal_lm(micro_model_dir, tokenizer, dtype="float32", device=torch.device("cpu"))
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, 42]
    assert stop_token_ids(model, tokenizer) == {tokenizer.eos_token_id, 42}


def test_sample_categorical_draws_the_given_distribution():
    from honing.rollout.native.sampling import sample_categorical

    # Unnormalised weights 1 : 5 : 0 : 4 (the 0 is a token masked out by top-k / top-p).
    probs = torch.tensor([[0.1, 0.5, 0.0, 0.4]]).repeat(20000, 1) * 3.0
    generator = torch.Generator().manual_seed(0)
    tokens = sample_categorical(probs, generator)
    frequencies = torch.bincount(tokens, minlength=4).float() / len(tokens)
    assert frequencies[2] == 0
    # 20000 draws: the standard error of a frequency is <= 0.0036; allow ~4 of them.
    torch.testing.assert_close(frequencies, torch.tensor([0.1, 0.5, 0.0, 0.4]), atol=0.015, rtol=0)
    again = sample_categorical(probs, torch.Generator().manual_seed(0))
    assert torch.equal(tokens, again)


@pytest.mark.parametrize("extra", [77, -128], ids=["padded", "half-blocks"])
def test_sample_categorical_over_many_blocks_inverts_the_whole_cdf(extra):
    """Across blocks (a vocabulary that no block size divides, or one that half blocks do;
    masked tokens, rows whose mass sits in one block), the two-level inversion draws the token
    that one float64 running sum over the whole vocabulary gives for the same uniform; masked
    tokens never."""
    from honing.rollout.native.sampling import SAMPLE_BLOCK, sample_categorical

    vocab = SAMPLE_BLOCK * 4 + extra
    gen = torch.Generator().manual_seed(3)
    probs = torch.rand(4000, vocab, generator=gen) ** 8  # peaked, like a trained model
    probs[:, SAMPLE_BLOCK - 5 : SAMPLE_BLOCK + 5] = 0  # masked across a block boundary
    probs[:, -1] = 0
    probs[:100] = 0
    probs[:100, SAMPLE_BLOCK * 2 + 3] = 2.0  # all the mass on one token
    tokens = sample_categorical(probs, torch.Generator().manual_seed(0))

    u = torch.rand(len(probs), 1, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    cdf = probs.cumsum(-1, dtype=torch.float64)
    want = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(-1)
    assert (tokens != want).sum() <= 2  # only float64 rounding at a boundary may differ
    assert (probs.gather(-1, tokens[:, None]) > 0).all()
    assert (tokens[:100] == SAMPLE_BLOCK * 2 + 3).all()


def test_a_kept_cache_continues_a_sample_as_one_call_would(model, tokenizer):
    """Greedy samples continued 2 tokens at a time from their kept caches equal one call of
    8 tokens, token for token; unkeyed, every call computes the cache again, with the same
    tokens."""
    engine = TransformersEngine(model, tokenizer, device=CPU)
    assert engine.keeps_kv
    whole = SamplingParams(n=1, max_new_tokens=8, max_seq_len=64, greedy=True)
    once = {r.prompt_id: r for r in engine.generate(requests_for(tokenizer), whole)}
    engine.take_report()
    for key in (True, False):
        chunk = replace(whole, max_new_tokens=2)
        made = continued(engine, requests_for(tokenizer), chunk, 4, keyed=key, reseed=True)
        kept = engine.take_report()[0].get("partial/kv_kept_tokens", 0)
        assert (kept > 0) == key
        for prompt_id, (ids, logprobs) in made.items():
            length = len(once[prompt_id].response_ids)
            assert ids[:length] == once[prompt_id].response_ids
            torch.testing.assert_close(
                torch.tensor(logprobs[:length]),
                torch.tensor(once[prompt_id].behaviour_logprobs),
                atol=1e-5,
                rtol=0,
            )


def test_after_new_weights_a_kept_sample_goes_on_from_the_old_weights_cache(model, tokenizer):
    """Two tokens with the old weights, new weights, then 3 more: each later token's logprob
    is the new model's with the old model's cache of the earlier tokens (built here with
    the models' own forward and KV cache), and differs from the new model's own forward."""
    old = copy.deepcopy(model)
    new = copy.deepcopy(model)
    with torch.no_grad():
        for param in new.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    engine = TransformersEngine(copy.deepcopy(old), tokenizer, device=CPU)
    state = [[(n, t.detach().clone()) for n, t in new.state_dict().items()]]
    params = SamplingParams(n=1, max_new_tokens=2, max_seq_len=64, temperature=0.9)

    def update(call):
        if call == 0:
            engine.load_weights(1, state)

    requests = requests_for(tokenizer)
    prompts = {r.prompt_id: r.prompt_ids for r in requests}
    made = continued(engine, requests, params, 2, reseed=True, between=update)
    cache_arg = engine._cache_arg
    checked = 0
    for prompt_id, (ids, logprobs) in made.items():
        if len(ids) < 3:  # ended in its first chunk: nothing continued
            continue
        prompt = prompts[prompt_id]
        with torch.no_grad():
            cache = old(torch.tensor([prompt + ids[:1]]), use_cache=True)[cache_arg]
            logits = new(torch.tensor([ids[1:-1]]), use_cache=True, **{cache_arg: cache}).logits
        later = (logits[0].float() / 0.9).log_softmax(-1).gather(-1, torch.tensor(ids[2:])[:, None])
        torch.testing.assert_close(torch.tensor(logprobs[2:]), later[:, 0], atol=2e-5, rtol=0)
        recomputed = full_forward_logprobs(new, prompt, ids, temperature=0.9)[2:]
        assert (recomputed - later[:, 0]).abs().max() > 1e-3  # the kept cache made a difference
        checked += 1
    assert checked >= 2
