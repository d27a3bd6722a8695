"""The fast decoder against the Hugging Face forward of the same modules.

Two models: the repo's micro Llama (trained a little, so its distributions are peaked) and a
random Qwen2 with q/k/v biases, grouped-query attention (4 heads, 2 KV heads) and non-trivial
norm weights. Prompts of different lengths share a batch, so most rows are left-padded.
"""

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from honing.models import llama_block
from honing.models.loading import load_causal_lm, load_tokenizer
from honing.rollout.base import GenerationRequest, SamplingParams
from honing.rollout.native.engine import TransformersEngine, _HFDecoder, _left_pad
from honing.rollout.native.fast_decode import FastDecoder, supports

CPU = torch.device("cpu")
PROMPTS = ["7+5=", "13+45=", "a", "99+9=", "+", "1234+5678="]


@pytest.fixture(scope="module")
def tokenizer(micro_model_dir):
    return load_tokenizer(micro_model_dir)


def qwen2(tokenizer, **overrides) -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=48,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        **overrides,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # HF initialises biases to 0 and norms to 1: make them matter
        for name, param in model.named_parameters():
            if "bias" in name or "norm" in name:
                param.add_(torch.randn_like(param) * 0.3)
    return model


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request, micro_model_dir, tokenizer):
    if request.param == "llama":
        return load_causal_lm(micro_model_dir, tokenizer, dtype="float32", device=CPU).eval()
    return qwen2(tokenizer)


def left_padded(tokenizer, prompts=PROMPTS):
    ids, mask = _left_pad([tokenizer.encode(p) for p in prompts], tokenizer.pad_token_id)
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


@pytest.fixture(params=["stacked", "separate"])
def weights(request, monkeypatch):
    """q/k/v and gate/up stacked into one matrix each (small models), or each projection on
    its own weights (big models; forced here by the threshold)."""
    if request.param == "separate":
        monkeypatch.setattr(llama_block, "FUSE_BYTES", 0)
    return request.param


def hf_decoder(model, tokenizer) -> _HFDecoder:
    """The engine's decoder over the Hugging Face forward, which passes the KV cache under the
    argument name of the installed transformers (``cache`` or ``past_key_values``: a wrong one
    is taken silently and each step then sees only its own token)."""
    return TransformersEngine(model, tokenizer, device=CPU, fast_decode=False)._decoder()


@torch.no_grad()
def test_prefill_and_decode_logits_equal_the_hf_forward(model, tokenizer, weights):
    assert supports(model) is True
    ids, mask, positions = left_padded(tokenizer)
    fast, hf = FastDecoder(model), hf_decoder(model, tokenizer)
    expected = hf.prefill(ids, mask, positions, 5)  # [B, V]
    actual = fast.prefill(ids, mask, positions, 5)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=0)
    generator = torch.Generator().manual_seed(0)
    for _ in range(5):  # feed the same (random) tokens to both
        token = torch.randint(3, len(tokenizer), (len(PROMPTS),), generator=generator)
        positions = positions[:, -1:] + 1
        torch.testing.assert_close(
            fast.step(token, positions), hf.step(token, positions), atol=1e-5, rtol=0
        )


def generate_both(model, tokenizer, params):
    requests = [GenerationRequest(f"p{i}", tokenizer.encode(t), i) for i, t in enumerate(PROMPTS)]
    fast = TransformersEngine(model, tokenizer, device=CPU)
    hf = TransformersEngine(model, tokenizer, device=CPU, fast_decode=False)
    assert fast.fast_decode and not hf.fast_decode
    return fast.generate(requests, params), hf.generate(requests, params)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(n=1, max_new_tokens=12, greedy=True),
        SamplingParams(n=4, max_new_tokens=12, seed=3),
        SamplingParams(n=4, max_new_tokens=12, temperature=0.7, top_k=5, top_p=0.9, seed=4),
    ],
    ids=["greedy", "sampled", "filtered"],
)
def test_generation_is_token_identical_to_the_hf_path(model, tokenizer, params, weights):
    fast, hf = generate_both(model, tokenizer, params)
    assert [r.response_ids for r in fast] == [r.response_ids for r in hf]
    assert [r.finish_reason for r in fast] == [r.finish_reason for r in hf]
    for a, b in zip(fast, hf, strict=True):
        torch.testing.assert_close(
            torch.tensor(a.behaviour_logprobs),
            torch.tensor(b.behaviour_logprobs),
            atol=1e-5,
            rtol=0,
        )
    assert max(len(r.response_ids) for r in fast) > 4  # the decode steps were exercised


@torch.no_grad()
def test_a_weight_update_is_seen_without_rebuilding(tokenizer):
    model = qwen2(tokenizer)
    fast = FastDecoder(model)
    ids, mask, positions = left_padded(tokenizer)
    before = fast.prefill(ids, mask, positions, 1)
    # In place, as an optimizer step does, and by load_state_dict (copies into the parameters).
    model.model.layers[1].mlp.up_proj.weight.mul_(3.0)
    state = {k: v + 0.01 for k, v in model.state_dict().items() if "norm" in k}
    model.load_state_dict(state, strict=False)
    after = fast.prefill(ids, mask, positions, 1)
    assert not torch.allclose(before, after, atol=1e-3)
    expected = hf_decoder(model, tokenizer).prefill(ids, mask, positions, 1)
    torch.testing.assert_close(after, expected, atol=1e-5, rtol=0)


def gpt2(tokenizer):
    return GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=16, n_layer=1, n_head=2))


def llama_with_linear_rope(tokenizer):
    rope = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        rope_parameters=rope,
    )
    return LlamaForCausalLM(config)


@pytest.mark.parametrize(
    ("build", "reason"),
    [
        (gpt2, "not Llama-family"),
        (llama_with_linear_rope, "rope type 'linear'"),
        (lambda tok: qwen2(tok, use_sliding_window=True, sliding_window=4), "sliding window"),
        (lambda tok: qwen2(tok, hidden_act="gelu"), "not silu"),
        (lambda tok: qwen2(tok).to(torch.float64), "dtype torch.float64"),
    ],
    ids=["gpt2", "rope-scaling", "sliding-window", "gelu", "float64"],
)
def test_unsupported_models_fall_back_to_the_hf_path(tokenizer, build, reason):
    model = build(tokenizer).eval()
    assert reason in supports(model)
    with pytest.raises(ValueError, match="fast decoding does not apply"):
        FastDecoder(model)
    engine = TransformersEngine(model, tokenizer, device=CPU)
    assert not engine.fast_decode and reason in engine.fast_decode_reason
    request = GenerationRequest("p", tokenizer.encode("1+2="), 0)
    (rollout,) = engine.generate([request], SamplingParams(max_new_tokens=3, seed=0))
    assert 1 <= len(rollout.response_ids) <= 3
