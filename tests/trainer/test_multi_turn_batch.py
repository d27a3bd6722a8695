"""A multi-turn batch (tool responses inside the responses) through the trainer's passes:
the structure follows the real tokens, the loss the sampled ones."""

import torch

from honing.models.loading import load_causal_lm, load_tokenizer
from honing.trainer.batch import collate, response_logprobs
from honing.types import Rollout


def rollouts(tokenizer) -> list[Rollout]:
    """Two samples of one prompt: one with a tool response (5 tokens) after its first 3,
    then 4 more sampled; one of 2 sampled tokens."""
    prompt = tokenizer.encode("12+34=", add_special_tokens=False)
    ids = list(range(20, 32))
    return [
        Rollout(
            "p",
            0,
            prompt,
            ids,
            [-1.0] * 3 + [0.0] * 5 + [-1.0] * 4,
            "stop",
            0,
            "",
            tool_spans=[(3, 5)],
            turns=2,
        ),
        Rollout("p", 0, prompt, ids[:2], [-1.0] * 2, "stop", 0, ""),
    ]


def test_the_passes_run_every_real_token_and_score_the_sampled_ones(micro_model_dir):
    """The packed forward (its stream built from the real tokens) and the model's own give
    the same logprobs on the sampled tokens; trimming to a row set keeps the tokens after a
    tool response (the width is the real length, 12, not the 7 sampled)."""
    tokenizer = load_tokenizer(micro_model_dir)
    model = load_causal_lm(micro_model_dir, tokenizer, dtype="float32", device="cpu")
    batch = collate(rollouts(tokenizer), tokenizer.pad_token_id, torch.device("cpu"))
    assert batch.response_mask[0].tolist() == [1.0] * 3 + [0.0] * 5 + [1.0] * 4
    first = batch.select(torch.tensor([0]))
    assert first.responses.shape[1] == 12 and first.response_mask.sum() == 7
    with torch.no_grad():
        plain, _ = response_logprobs(model, batch, packed=False)
        packed, _ = response_logprobs(model, batch, packed=True)
        alone, _ = response_logprobs(model, first, packed=True)
    sampled = batch.response_mask.bool()
    torch.testing.assert_close(packed[sampled], plain[sampled], atol=1e-5, rtol=0)
    torch.testing.assert_close(
        alone[0][first.response_mask[0].bool()], plain[0][sampled[0]], atol=1e-5, rtol=0
    )
