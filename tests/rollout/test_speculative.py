"""Speculative decoding keeps the policy's distribution exactly: the same token distributions
as plain sampling (statistically, with a draft that often disagrees), the same greedy output,
logprobs that are the policy's, and the automatic switch that turns a bad draft off."""

import collections

import pytest
import torch

from honing.data import warmstart_corpus
from honing.models.loading import load_causal_lm, load_tokenizer
from honing.models.tiny import TinySpec, build_tiny_model
from honing.rollout.base import GenerationRequest, SamplingParams
from honing.rollout.native.engine import TransformersEngine
from honing.rollout.native.mtp import MtpHeads
from honing.rollout.native.speculative import SpecStats, Speculation
from tests.rollout.stopping import assert_cut_at_a_stop_id

ROWS = 6000


@pytest.fixture(scope="module")
def tokenizer(micro_model_dir):
    return load_tokenizer(micro_model_dir)


@pytest.fixture(scope="module")
def policy(micro_model_dir, tokenizer):
    return load_causal_lm(micro_model_dir, tokenizer, dtype="float32", device="cpu").eval()


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory, tokenizer):
    """A model of the same tokenizer that disagrees with the policy (other seed, little
    training)."""
    spec = TinySpec(
        hidden_size=32,
        num_layers=1,
        num_heads=2,
        intermediate_size=64,
        warmstart_steps=5,
        warmstart_batch=32,
        seed=7,
    )
    corpus = warmstart_corpus(200, 3, 2, 0.9)
    path = build_tiny_model(tmp_path_factory.mktemp("draft"), corpus, spec, log=lambda m: None)
    return load_causal_lm(path, tokenizer, dtype="float32", device="cpu").eval()


def random_heads(policy, count=4):
    heads = MtpHeads(policy.config.hidden_size, count)
    with torch.no_grad():
        for block in heads.blocks:
            block.out.weight.normal_(0, 0.3)
    return heads


def engine(policy, tokenizer, speculation=None):
    return TransformersEngine(
        policy,
        tokenizer,
        device=torch.device("cpu"),
        generation_batch=ROWS,
        speculation=speculation,
    )


def sample(eng, tokenizer, params, prompt="12 + 7 ="):
    request = GenerationRequest("p", tokenizer.encode(prompt), 0)
    return eng.generate([request], params)


def distribution(rollouts, position):
    counts = collections.Counter(
        r.response_ids[position] if len(r.response_ids) > position else -1 for r in rollouts
    )
    return {token: n / len(rollouts) for token, n in counts.items()}


def same_distribution_z(a, b):
    """The two-sample chi-square statistic of two equal-size samples' token frequencies, as a
    normal deviate (Wilson-Hilferty): about N(0, 1) when both come from one distribution.
    Tokens seen fewer than 10 times in both together are pooled into one bin."""
    tokens = set(a) | set(b)
    counts = [(a.get(t, 0) * ROWS, b.get(t, 0) * ROWS) for t in tokens]
    bins = [c for c in counts if c[0] + c[1] >= 10]
    rest = [c for c in counts if c[0] + c[1] < 10]
    if rest:
        bins.append((sum(c[0] for c in rest), sum(c[1] for c in rest)))
    stat = sum((x - y) ** 2 / (x + y) for x, y in bins if x + y)
    df = max(len(bins) - 1, 1)
    return ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / (2 / (9 * df)) ** 0.5


@pytest.mark.parametrize(
    "kind,params",
    [
        ("draft", SamplingParams(n=ROWS, max_new_tokens=4, temperature=1.3, seed=3)),
        ("draft", SamplingParams(n=ROWS, max_new_tokens=4, temperature=0.8, top_k=6, seed=4)),
        ("ngram", SamplingParams(n=ROWS, max_new_tokens=4, temperature=1.3, seed=5)),
        ("mtp", SamplingParams(n=ROWS, max_new_tokens=4, temperature=1.3, seed=6)),
    ],
)
def test_tokens_follow_the_policys_distribution(policy, other_draft, tokenizer, kind, params):
    plain = sample(engine(policy, tokenizer), tokenizer, params)
    drafts = {"draft": other_draft, "mtp": random_heads(policy), "ngram": None}
    spec = Speculation(kind, 3, 0.0, 20, drafts[kind])
    fast = engine(policy, tokenizer, spec)
    drafted = sample(fast, tokenizer, params)
    metrics, _ = fast.take_report()
    rate = metrics["rollout/spec_accept_rate"]
    assert 0.001 < rate < 0.95  # both the accept and the reject paths run
    for position in range(4):
        z = same_distribution_z(distribution(plain, position), distribution(drafted, position))
        assert z < 4.5, (position, z)
    if kind == "draft":  # the test can fail: the draft's own distribution is far off
        alone = sample(engine(other_draft, tokenizer), tokenizer, params)
        assert same_distribution_z(distribution(plain, 1), distribution(alone, 1)) > 20


def test_greedy_output_and_logprobs_are_the_policys(policy, other_draft, tokenizer):
    params = SamplingParams(n=1, max_new_tokens=12, greedy=True)
    prompts = ["12 + 7 =", "3 + 45 =", "1 + 1 ="]
    requests = [GenerationRequest(f"p{i}", tokenizer.encode(p), i) for i, p in enumerate(prompts)]
    plain = engine(policy, tokenizer).generate(requests, params)
    for kind in ("draft", "ngram", "mtp"):
        spec = Speculation(kind, 4, 0.0, 20, random_heads(policy) if kind == "mtp" else other_draft)
        drafted = engine(policy, tokenizer, spec).generate(requests, params)
        for a, b in zip(plain, drafted, strict=True):
            assert a.response_ids == b.response_ids and a.finish_reason == b.finish_reason
            assert a.behaviour_logprobs == pytest.approx(b.behaviour_logprobs, abs=1e-5)


def test_a_draft_with_another_vocabulary_size_still_drafts_exactly(policy, tokenizer):
    """Drafts of one family often differ only in padding rows of the vocabulary."""
    import copy

    params = SamplingParams(n=1, max_new_tokens=10, greedy=True)
    requests = [GenerationRequest(f"p{i}", tokenizer.encode(f"{i} + 3 ="), i) for i in range(3)]
    plain = engine(policy, tokenizer).generate(requests, params)
    size = policy.get_output_embeddings().weight.shape[0]
    for extra in (8, -3):
        draft = copy.deepcopy(policy)
        draft.resize_token_embeddings(size + extra)
        fast = engine(policy, tokenizer, Speculation("draft", 3, 0.0, 20, draft))
        got = fast.generate(requests, params)
        assert [r.response_ids for r in got] == [r.response_ids for r in plain]
        metrics, _ = fast.take_report()
        assert metrics["rollout/spec_accept_rate"] > 0.5


def test_a_call_that_drafted_nothing_leaves_the_switch_alone():
    spec = Speculation("ngram", 4, 0.5, 20)
    assert spec.record(SpecStats()) == ({"rollout/spec_enabled": 1.0}, [])
    assert spec.enabled


def test_sampled_logprobs_are_the_policys_teacher_forced(policy, other_draft, tokenizer):
    params = SamplingParams(n=8, max_new_tokens=6, temperature=1.0, seed=9)
    spec = Speculation("draft", 3, 0.0, 20, other_draft)
    for rollout in sample(engine(policy, tokenizer, spec), tokenizer, params):
        ids = torch.tensor([rollout.prompt_ids + rollout.response_ids])
        with torch.no_grad():
            logp = policy(input_ids=ids).logits[0].log_softmax(-1)
        start = len(rollout.prompt_ids)
        want = [logp[start - 1 + j, token].item() for j, token in enumerate(rollout.response_ids)]
        assert rollout.behaviour_logprobs == pytest.approx(want, abs=1e-4)


def test_a_draft_equal_to_the_policy_is_always_accepted(policy, tokenizer):
    spec = Speculation("draft", 4, 0.5, 20, policy)
    fast = engine(policy, tokenizer, spec)
    sample(fast, tokenizer, SamplingParams(n=16, max_new_tokens=8, seed=1))
    metrics, events = fast.take_report()
    assert metrics["rollout/spec_accept_rate"] > 0.99 and events == []


def test_a_bad_draft_turns_itself_off_and_a_probe_turns_it_on(policy, other_draft, tokenizer):
    spec = Speculation("draft", 4, 0.9, 3, other_draft)
    fast = engine(policy, tokenizer, spec)
    params = SamplingParams(n=32, max_new_tokens=8, seed=2)
    sample(fast, tokenizer, params)
    metrics, events = fast.take_report()
    assert [kind for kind, _ in events] == ["speculation_off"]
    assert metrics["rollout/spec_enabled"] == 1.0
    for _ in range(2):  # off: plain decoding
        sample(fast, tokenizer, params)
        assert fast.take_report() == ({"rollout/spec_enabled": 0.0}, [])
    spec.draft_model = policy  # the draft caught up; the third call off is a probe
    sample(fast, tokenizer, params)
    metrics, events = fast.take_report()
    assert [kind for kind, _ in events] == ["speculation_on"]
    assert metrics["rollout/spec_accept_rate"] > 0.99


@pytest.mark.parametrize("kind", [None, "ngram"])
def test_a_generation_timeout_cuts_runaway_samples_and_counts_them(policy, tokenizer, kind):
    spec = Speculation(kind, 2, 0.0, 20) if kind else None
    eng = TransformersEngine(
        policy, tokenizer, device=torch.device("cpu"), speculation=spec, gen_timeout_s=1e-9
    )
    rollouts = sample(eng, tokenizer, SamplingParams(n=4, max_new_tokens=30, seed=1))
    cut = [r for r in rollouts if r.finish_reason == "abort"]
    assert cut and all(len(r.response_ids) == len(r.behaviour_logprobs) for r in rollouts)
    assert all(tokenizer.pad_token_id not in r.response_ids for r in cut)
    metrics, _ = eng.take_report()
    assert metrics["rollout/gen_timeouts"] == len(cut)


def test_speculation_on_a_policy_without_the_fast_path_is_a_config_error(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    from honing.config import build_config
    from honing.errors import ConfigError
    from honing.models.tiny import build_tokenizer
    from honing.pipeline.rollout_engines import speculation

    tokenizer = build_tokenizer()
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_layer=1, n_embd=16, n_head=2))
    config = build_config({"rollout.speculative": "ngram"})
    with pytest.raises(ConfigError, match="fast decode path"):
        speculation(config, tokenizer, torch.device("cpu"), gpt2)


@pytest.mark.parametrize("kind", ["draft", "ngram"])
def test_a_drafted_response_ends_at_a_call_s_stop_id(policy, tokenizer, kind):
    """``SamplingParams.stop_ids`` (the turn loop's closing tag) ends a speculated response at
    the first of them, though a round drafted tokens past it (with the policy as its own
    draft every draft is accepted, up to 5 tokens a round): each sample, drawn with the same
    seed, is the one drawn without the stop id, cut there, as ``stop``."""
    params = SamplingParams(n=4, max_new_tokens=12, max_seq_len=64, temperature=1.5, seed=3)
    requests = [GenerationRequest(f"p{i}", tokenizer.encode(f"{i}{i}+3{i}="), i) for i in range(4)]
    draft = policy if kind == "draft" else None
    fast = engine(policy, tokenizer, Speculation(kind, 4, 0.0, 20, draft))
    assert_cut_at_a_stop_id(fast, requests, params)
    assert fast.take_report()[0]["rollout/spec_accept_rate"] > 0


@pytest.mark.parametrize("kind", ["ngram", "mtp"])
def test_drafted_tokens_carry_the_experts_plain_decoding_routes_them_to(tokenizer, kind):
    """Routing replay R3 with speculative decoding: each token's routed experts are those of
    the policy's pass that took it as input (the prompt's from the prefill, then t, x_1 ..
    x_a of every verify round), as many rows as plain decoding records. Greedy, so both
    decode the same tokens; the choices agree but for float ties between a batched verify
    pass and one-token steps."""
    from tests.models.moe_models import moe_model

    policy = moe_model("qwen3_moe", len(tokenizer), tokenizer.pad_token_id).eval()
    params = SamplingParams(n=2, max_new_tokens=16, max_seq_len=64, greedy=True)
    requests = [GenerationRequest(f"p{i}", tokenizer.encode(f"{i}{i}+3{i}="), i) for i in range(3)]
    plain = engine(policy, tokenizer).generate(requests, params)
    draft = random_heads(policy) if kind == "mtp" else None
    fast = engine(policy, tokenizer, Speculation(kind, 3, 0.0, 20, draft))
    drafted = fast.generate(requests, params)
    assert fast.take_report()[0]["rollout/spec_draft_tokens"] > 0
    same = total = 0
    for want, got in zip(plain, drafted, strict=True):
        assert got.response_ids == want.response_ids
        assert got.routed_experts.shape == want.routed_experts.shape
        rows = len(want.prompt_ids) + len(want.response_ids) - 1
        assert len(got.routed_experts) == rows
        same += int(
            (got.routed_experts.sort(-1).values == want.routed_experts.sort(-1).values).sum()
        )
        total += want.routed_experts.numel()
    assert same / total > 0.99, same / total
