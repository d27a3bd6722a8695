"""Rollouts -> padded tensors: layout, masks from lengths, trimming, and the policy's logprobs."""

import pytest
import torch

from honing.models.loading import load_causal_lm, load_tokenizer
from honing.trainer.batch import collate, response_logprobs
from honing.types import Rollout

CPU = torch.device("cpu")
PAD, EOS = 0, 1


def rollout(prompt_ids, response_ids, logprobs=None, reason="stop") -> Rollout:
    return Rollout(
        prompt_id="p",
        group_index=0,
        prompt_ids=prompt_ids,
        response_ids=response_ids,
        behaviour_logprobs=logprobs or [-0.5] * len(response_ids),
        finish_reason=reason,
        weight_version=0,
        text="",
    )


@pytest.fixture
def batch():
    return collate(
        [
            # Stops with EOS after one token.
            rollout([5, 6, 7], [8, EOS], [-0.5, -0.25]),
            # A response made of tokens equal to the pad id: only lengths can tell them apart.
            rollout([9], [PAD, 4, PAD], [-1.0, -2.0, -3.0], reason="length"),
        ],
        pad_id=PAD,
        device=CPU,
    )


def test_collate_layout(batch):
    # Prompt width 3 (left-padded), response width 3 (right-padded).
    assert batch.prompt_width == 3
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, EOS, PAD], [PAD, PAD, 9, PAD, 4, PAD]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]]
    # Positions count from each row's first real token.
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 4], [0, 0, 0, 1, 2, 3]]
    assert batch.responses.tolist() == [[8, EOS, PAD], [PAD, 4, PAD]]
    assert len(batch) == 2


def test_response_mask_covers_the_final_eos_and_pad_valued_tokens(batch):
    assert batch.response_mask.tolist() == [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]
    assert batch.response_mask.dtype == torch.float32


def test_behaviour_logprobs_are_right_padded_with_zeros(batch):
    expected = torch.tensor([[-0.5, -0.25, 0.0], [-1.0, -2.0, -3.0]])
    assert torch.equal(batch.behaviour_logprobs, expected)


def test_select_trims_to_the_longest_selected_response(batch):
    first = batch.select(torch.tensor([0]))
    assert first.prompt_width == 3
    assert first.input_ids.tolist() == [[5, 6, 7, 8, EOS]]
    assert first.attention_mask.tolist() == [[1, 1, 1, 1, 1]]
    assert first.position_ids.tolist() == [[0, 1, 2, 3, 4]]
    assert first.responses.tolist() == [[8, EOS]]
    assert first.response_mask.tolist() == [[1.0, 1.0]]
    assert first.behaviour_logprobs.tolist() == [[-0.5, -0.25]]
    both = batch.select(torch.tensor([1, 0]))  # order follows the index
    assert both.input_ids.tolist() == [[PAD, PAD, 9, PAD, 4, PAD], [5, 6, 7, 8, EOS, PAD]]
    assert both.response_mask.tolist() == [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]


def test_empty_response_keeps_one_masked_column():
    batch = collate([rollout([3, 4], [], [], reason="abort")], pad_id=PAD, device=CPU)
    assert batch.input_ids.tolist() == [[3, 4, PAD]]
    assert batch.attention_mask.tolist() == [[1, 1, 0]]
    assert batch.response_mask.tolist() == [[0.0]]
    assert batch.select(torch.tensor([0])).responses.shape == (1, 1)


# --- logprobs of the policy on a batch --------------------------------------------------------


@pytest.fixture(scope="module")
def model(micro_model_dir):
    tokenizer = load_tokenizer(micro_model_dir)
    return load_causal_lm(micro_model_dir, tokenizer, dtype="float32", device=CPU).eval()


@torch.no_grad()
def test_response_logprobs_match_unpadded_forward(model):
    rows = [
        rollout([20, 21, 15, 22, 33], [25, 26, EOS]),
        rollout([40], [41, 42, 43, 44, 45], reason="length"),
        rollout([30, 15, 31], [EOS]),
    ]
    batch = collate(rows, pad_id=PAD, device=CPU)
    for temperature in (1.0, 0.7):
        logprobs, entropy = response_logprobs(
            model, batch, temperature=temperature, with_entropy=True
        )
        assert logprobs.shape == entropy.shape == batch.response_mask.shape == (3, 5)
        for i, r in enumerate(rows):
            ids = torch.tensor([r.prompt_ids + r.response_ids])
            logits = model(input_ids=ids).logits[0, len(r.prompt_ids) - 1 : -1] / temperature
            logp = logits.log_softmax(-1)  # [R_i, V]
            expected = logp.gather(-1, torch.tensor(r.response_ids)[:, None]).squeeze(-1)
            n = len(r.response_ids)
            torch.testing.assert_close(logprobs[i, :n], expected, atol=1e-5, rtol=0)
            expected_entropy = -(logp.exp() * logp).sum(-1)
            torch.testing.assert_close(entropy[i, :n], expected_entropy, atol=1e-5, rtol=0)


def test_entropy_carries_a_gradient_only_when_asked(model):
    batch = collate([rollout([20, 21], [22, EOS])], pad_id=PAD, device=CPU)
    logprobs, entropy = response_logprobs(model, batch, with_entropy=True)
    assert logprobs.requires_grad and not entropy.requires_grad
    _, entropy = response_logprobs(model, batch, with_entropy=True, entropy_grad=True)
    assert entropy.requires_grad
    assert response_logprobs(model, batch)[1] is None


def test_chunked_head_gives_the_same_values_and_gradients(model, monkeypatch):
    """With the head fused with the logprob in chunks of tokens (as for long responses with a
    big vocabulary), logprobs, entropies and parameter gradients match the plain path on real
    tokens; padding positions are 0."""
    import honing.trainer.batch as batch_module

    rows = [
        rollout([20, 21, 15, 22, 33], [25, 26, EOS]),
        rollout([40], [41, 42, 43, 44, 45], reason="length"),
        rollout([30, 15, 31], [EOS]),
    ]
    batch = collate(rows, pad_id=PAD, device=CPU)

    def run():
        model.zero_grad()
        logprobs, entropy = response_logprobs(
            model, batch, temperature=0.7, with_entropy=True, entropy_grad=True
        )
        mask = batch.response_mask
        ((logprobs * mask * weights[0]).sum() + (entropy * mask * weights[1]).sum()).backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        return logprobs.detach(), entropy.detach(), grads

    weights = torch.randn(2, *batch.response_mask.shape, generator=torch.Generator().manual_seed(0))
    plain = run()
    vocab = model.get_output_embeddings().weight.shape[0]
    monkeypatch.setattr(batch_module, "HEAD_CHUNK_LOGITS", 4 * vocab)  # 4 tokens a chunk
    assert batch_module._chunked_head(model, batch, 5)
    chunked = run()
    real = batch.response_mask.bool()
    for got, want in zip(chunked[:2], plain[:2], strict=True):
        torch.testing.assert_close(got[real], want[real], atol=1e-6, rtol=0)
        assert (got[~real] == 0).all()
    assert len(chunked[2]) == len(plain[2])
    for got, want in zip(chunked[2], plain[2], strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
