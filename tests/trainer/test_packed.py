"""The packed forward (prompts once per group, no padding) against the model's own forward.

A batch like GRPO's: three prompts of different lengths, each with several completions of
different lengths (one empty, one of a single token), so rows are padded on both sides and
prompts repeat. Logprobs, entropies and every parameter's gradient must match the padded
Hugging Face forward, for a random Qwen2 with q/k/v biases and grouped-query attention and for
the repo's micro Llama.
"""

import warnings

import pytest
import torch

from honing.models import llama_block
from honing.models.llama_block import unwrap
from honing.models.loading import (
    activation_checkpointing,
    load_causal_lm,
    load_tokenizer,
    set_activation_checkpointing,
)
from honing.trainer import packed
from honing.trainer.batch import collate, response_logprobs
from honing.trainer.packed import packed_layout, packed_supported
from honing.types import Rollout
from tests.rollout.test_fast_decode import qwen2

CPU = torch.device("cpu")


@pytest.fixture(params=["small", "large"])
def path(request, monkeypatch):
    """Both paths: small (matmuls + softmax attention, q/k/v and gate/up as one stacked
    matmul each) and large (scaled_dot_product_attention, as long responses take, and each
    projection on its own weight, as big models take), forced here by the thresholds."""
    if request.param == "large":
        monkeypatch.setattr(packed, "MATH_ATTENTION_BYTES", 0)
        monkeypatch.setattr(llama_block, "FUSE_BYTES", 0)
    return request.param


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request, micro_model_dir):
    tokenizer = load_tokenizer(micro_model_dir)
    if request.param == "llama":
        return load_causal_lm(micro_model_dir, tokenizer, dtype="float32", device=CPU)
    return qwen2(tokenizer)  # q/k/v biases, grouped-query attention, non-trivial norms


def grpo_like_batch(vocab: int, pad: int, shared: bool = True, longer: int = 1):
    """``shared``: a group's rows share its prompt; else each row's prompt ends in a token of
    its own (the causal layout: a block per row). ``longer``: responses that many times as
    long (at 8, long against the shared prompts: the causal layout too)."""
    generator = torch.Generator().manual_seed(1)
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
    lengths = [[4, 0, 7, 1], [3, 3, 6], [5, 2]]  # an empty and a one-token completion
    lengths = [[n * longer for n in group] for group in lengths]
    rollouts = []
    for index, (prompt, group) in enumerate(zip(prompts, lengths, strict=True)):
        for member, length in enumerate(group):
            if not shared:
                prompt = [*prompt[: 1 + member], 20 + member]
            response = torch.randint(3, vocab, (length,), generator=generator).tolist()
            rollouts.append(
                Rollout(
                    prompt_id=str(index),
                    group_index=member,
                    prompt_ids=prompt,
                    response_ids=response,
                    behaviour_logprobs=[-1.0] * length,
                    finish_reason="stop",
                    weight_version=0,
                    text="",
                )
            )
    order = torch.randperm(len(rollouts), generator=generator).tolist()  # groups interleaved
    return collate([rollouts[i] for i in order], pad_id=pad, device=CPU)


BATCHES = {"shared": (True, 1), "own": (False, 1), "long-answers": (True, 8)}


@pytest.fixture(scope="module", params=list(BATCHES))
def batch(model, request):
    """Rows that share their group's prompt (the shared blocks), each its own prompt, or
    sharing it with long answers (both: the causal layout)."""
    return grpo_like_batch(
        model.config.vocab_size, model.config.pad_token_id or 0, *BATCHES[request.param]
    )


def test_rows_with_prompts_of_their_own_run_as_causal_blocks(model):
    """No [T, T] mask and no padded prompt block: one block per row, its prompt then its
    response inputs, as long as the longest row."""
    batch = grpo_like_batch(model.config.vocab_size, model.config.pad_token_id or 0, False)
    layout = packed_layout(batch, CPU, torch.float32)
    lengths = (batch.attention_mask.sum(-1) - (batch.response_real.sum(-1) > 0).long()).tolist()
    assert layout.causal and layout.sees is None
    assert layout.query_slots.shape == (len(batch), max(lengths))
    assert layout.ids.numel() == layout.unpad.numel() == sum(lengths)
    shared = grpo_like_batch(model.config.vocab_size, model.config.pad_token_id or 0)
    assert not packed_layout(shared, CPU, torch.float32).causal


def test_long_answers_to_shared_prompts_run_as_causal_blocks_over_one_prompt_copy(model):
    """Where the shared blocks would pad every query row to the longest answer, each row is a
    causal block that gathers its group's one prompt copy: the stream still runs each prompt
    once, and each prompt token's output is read from its group's first row."""
    vocab, pad = model.config.vocab_size, model.config.pad_token_id or 0
    batch = grpo_like_batch(vocab, pad, longer=8)
    layout = packed_layout(batch, CPU, torch.float32)
    distinct_prompts = 5 + 2 + 3
    response_inputs = sum(max(8 * n - 1, 0) for n in [4, 0, 7, 1, 3, 3, 6, 5, 2])
    assert layout.causal and layout.sees is None
    assert layout.ids.numel() == layout.unpad.numel() == distinct_prompts + response_inputs
    flat = torch.arange(layout.ids.numel())
    assert torch.equal(layout.query_slots.flatten()[layout.unpad], flat)  # a slot that holds it
    width, prompt = layout.query_slots.shape[1], slice(0, batch.prompt_width)
    prompts = [
        tuple(row[real].tolist())
        for row, real in zip(
            batch.input_ids[:, prompt], batch.attention_mask[:, prompt].bool(), strict=True
        )
    ]
    first = {}
    for row, prompt in enumerate(prompts):
        first.setdefault(prompt, row)
    rows = (layout.unpad[:distinct_prompts] // width).tolist()
    assert [first[prompts[row]] for row in rows] == rows and len(set(rows)) == 3
    assert not packed_layout(grpo_like_batch(vocab, pad, longer=2), CPU, torch.float32).causal


def test_the_layout_runs_each_prompt_once_and_no_padding(model):
    batch = grpo_like_batch(model.config.vocab_size, model.config.pad_token_id or 0)
    layout = packed_layout(batch, CPU, torch.float32)
    distinct_prompts = 5 + 2 + 3
    response_inputs = sum(max(n - 1, 0) for n in [4, 0, 7, 1, 3, 3, 6, 5, 2])
    assert layout.ids.numel() == distinct_prompts + response_inputs
    assert batch.input_ids.numel() > 3 * layout.ids.numel()  # what the padded forward runs
    # One predictor per real response token, in response_mask order.
    assert layout.predictors.numel() == int(batch.response_mask.sum())


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_and_entropy_equal_the_models_own_forward(model, batch, temperature, path):
    model.eval()
    with torch.no_grad():
        expected, expected_entropy = response_logprobs(
            model, batch, temperature=temperature, with_entropy=True
        )
        packed, entropy = response_logprobs(
            model, batch, temperature=temperature, with_entropy=True, packed=True
        )
    mask = batch.response_mask.bool()
    torch.testing.assert_close(packed[mask], expected[mask], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(entropy[mask], expected_entropy[mask], atol=2e-5, rtol=1e-5)
    assert torch.all(packed[~mask] == 0) and torch.all(entropy[~mask] == 0)


def test_gradients_equal_the_models_own_forward(model, batch, path):
    model.train()
    weights = torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(2))

    def gradients(packed: bool) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        logprobs, entropy = response_logprobs(
            model, batch, with_entropy=True, entropy_grad=True, packed=packed
        )
        loss = ((logprobs + 0.1 * entropy) * weights * batch.response_mask).sum()
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    expected, packed = gradients(False), gradients(True)
    assert expected.keys() == packed.keys()
    for name, grad in expected.items():
        scale = grad.abs().max().clamp(min=1e-6)
        assert (packed[name] - grad).abs().max() / scale < 1e-4, name
    model.eval()


def test_unsupported_models_say_why_and_fall_back(model, batch):
    assert packed_supported(model) is True
    set_activation_checkpointing(model, True)
    try:
        assert activation_checkpointing(model)
        assert packed_supported(model) == "gradient checkpointing is on"
        with torch.no_grad():  # falls back to the model's forward: same numbers
            fallback, _ = response_logprobs(model, batch, packed=True)
            plain, _ = response_logprobs(model, batch)
        assert torch.equal(fallback, plain)
    finally:
        set_activation_checkpointing(model, False)
    assert not activation_checkpointing(model)


def test_checkpointing_is_switched_by_the_installed_releases_own_names(model):
    """On and off, on the model and through a LoRA wrapper, without the deprecated names
    (transformers releases that renamed it warn on each use of the old ones)."""
    wrapped = lora_wrapped(model)  # PEFT reads the old name when it wraps: outside the check
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        for module in (model, wrapped):
            set_activation_checkpointing(module, True)
            assert activation_checkpointing(module) and activation_checkpointing(unwrap(module))
            set_activation_checkpointing(module, False)
            assert not activation_checkpointing(module)


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_wrapped(model, dropout: float = 0.0):
    """A copy of ``model`` with rank-4 LoRA adapters on every projection, their B matrices
    random (PEFT starts them at 0, which would make the adapters a no-op)."""
    peft = pytest.importorskip("peft")
    copy = type(model)(model.config)
    copy.load_state_dict(model.state_dict())
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=LORA_TARGETS)
    wrapped = peft.get_peft_model(copy, config)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in wrapped.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    return wrapped


def test_lora_adapters_match_pefts_own_forward(model, batch, path):
    """The adapters enter the packed forward merged into q/k/v and gate/up and through the
    o/down layers' PEFT forward: the same logprobs, and the same adapter gradients."""
    wrapped = lora_wrapped(model).train()
    assert packed_supported(wrapped) is True
    weights = torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(4))

    def run(packed: bool):
        wrapped.zero_grad(set_to_none=True)
        logprobs, _ = response_logprobs(wrapped, batch, packed=packed)
        (logprobs * weights * batch.response_mask).sum().backward()
        grads = {n: p.grad.clone() for n, p in wrapped.named_parameters() if p.grad is not None}
        return logprobs.detach(), grads

    (expected, expected_grads), (packed_logprobs, packed_grads) = run(False), run(True)
    mask = batch.response_mask.bool()
    torch.testing.assert_close(packed_logprobs[mask], expected[mask], atol=2e-5, rtol=1e-5)
    assert expected_grads.keys() == packed_grads.keys()
    assert expected_grads and all("lora_" in name for name in expected_grads)
    for name, grad in expected_grads.items():
        scale = grad.abs().max().clamp(min=1e-6)
        assert (packed_grads[name] - grad).abs().max() / scale < 1e-4, name
    with torch.no_grad(), wrapped.disable_adapter():  # the reference: the base, adapters off
        base, _ = response_logprobs(wrapped, batch, packed=True)
        plain, _ = response_logprobs(model, batch)
    torch.testing.assert_close(base[mask], plain[mask], atol=2e-5, rtol=1e-5)
    assert (base[mask] - packed_logprobs[mask]).abs().max() > 1e-3  # the adapters mattered


def test_lora_dropout_in_training_falls_back(model):
    wrapped = lora_wrapped(model, dropout=0.1)
    assert packed_supported(wrapped.train()) == "LoRA dropout in training"
    assert packed_supported(wrapped.eval()) is True  # no dropout in eval: the same numbers


def test_bfloat16_weights_track_the_models_own_forward(model, batch, path):
    """A bfloat16 model (model.dtype=bfloat16): the same operations in bf16, so the two forwards
    agree to bf16 precision, not exactly (kernels accumulate in different orders)."""
    half = type(model)(model.config).to(torch.bfloat16).eval()
    half.load_state_dict(model.state_dict())
    with torch.no_grad():
        expected, _ = response_logprobs(half, batch)
        packed_logprobs, _ = response_logprobs(half, batch, packed=True)
    mask = batch.response_mask.bool()
    assert packed_supported(half) is True
    assert (packed_logprobs[mask] - expected[mask]).abs().max() < 0.03  # |logprob| ~ 4.5


def test_on_cuda_the_packed_forward_equals_the_models_own_forward(model, batch):
    """The same comparison on a GPU (index_select/index_add and SDPA's CUDA kernels)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    device = torch.device("cuda")
    gpu_model = type(model)(model.config).to(device).train()
    gpu_model.load_state_dict(model.state_dict())
    gpu_batch = collate_on(batch, device)
    grads = []
    for packed_path in (False, True):
        gpu_model.zero_grad(set_to_none=True)
        logprobs, _ = response_logprobs(gpu_model, gpu_batch, packed=packed_path)
        (logprobs * gpu_batch.response_mask).sum().backward()
        grads.append((logprobs.detach(), [p.grad.clone() for p in gpu_model.parameters()]))
    (expected, expected_grads), (packed_logprobs, packed_grads) = grads
    mask = gpu_batch.response_mask.bool()
    torch.testing.assert_close(packed_logprobs[mask], expected[mask], atol=1e-4, rtol=1e-4)
    for want, got in zip(expected_grads, packed_grads, strict=True):
        assert (got - want).abs().max() / want.abs().max().clamp(min=1e-6) < 1e-3


def collate_on(batch, device: torch.device):
    """``batch``'s tensors on ``device`` (a fresh batch: no cached layouts)."""
    from dataclasses import fields, replace

    moved = {
        f.name: getattr(batch, f.name).to(device)
        for f in fields(batch)
        if isinstance(getattr(batch, f.name), torch.Tensor)
    }
    return replace(batch, layouts={}, **moved)


def test_a_sampled_pad_token_gets_no_embedding_gradient_as_in_the_models_forward(model):
    """An untrained policy can sample the pad id as a real token: HF's embedding (its
    ``padding_idx``) gives that row no gradient from its inputs (a tied head still gives it
    one), and so must the packed forward."""
    pad = model.config.pad_token_id or 0
    assert model.get_input_embeddings().padding_idx == pad
    rollouts = [
        Rollout("0", 0, [5, 6, 7], [9, pad, 11], [-1.0] * 3, "stop", 0, ""),
        Rollout("0", 1, [5, 6, 7], [12, 13], [-1.0] * 2, "stop", 0, ""),
    ]
    batch = collate(rollouts, pad_id=pad, device=CPU)
    model.train()

    def embedding_gradient(packed: bool) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        logprobs, _ = response_logprobs(model, batch, packed=packed)
        (logprobs * batch.response_mask).sum().backward()
        return model.get_input_embeddings().weight.grad.clone()

    expected, packed = embedding_gradient(False), embedding_gradient(True)
    torch.testing.assert_close(packed, expected, atol=1e-5, rtol=1e-4)
    model.eval()
