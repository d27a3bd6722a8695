"""trainer.autocast: bf16 compute with float32 weights, gradients and optimizer state; the
fused LM head works under it; a run trains with it."""

import json

import pytest
import torch

from honing.backends.launch import train
from honing.models.loading import load_causal_lm, load_tokenizer
from honing.trainer import batch as batch_module
from honing.trainer.batch import collate, response_logprobs
from honing.trainer.policy_update import autocast
from honing.types import Rollout


def rollouts(tokenizer):
    out = []
    for i, (prompt, answer) in enumerate([("12 + 7 =", "19"), ("3 + 4 =", "7"), ("1 + 1 =", "2")]):
        response = tokenizer.encode(answer) + [tokenizer.eos_token_id]
        out.append(
            Rollout(
                prompt_id=f"p{i}",
                group_index=i,
                prompt_ids=tokenizer.encode(prompt),
                response_ids=response,
                behaviour_logprobs=[0.0] * len(response),
                finish_reason="stop",
                weight_version=0,
                text=answer,
            )
        )
    return out


@pytest.mark.parametrize("path", ["plain", "chunked", "packed"])
def test_bf16_autocast_logprobs_and_gradients_track_float32(micro_model_dir, monkeypatch, path):
    if path == "chunked":  # force the fused, chunked head on this small vocabulary
        monkeypatch.setattr(batch_module, "HEAD_CHUNK_LOGITS", 64)
    tokenizer = load_tokenizer(micro_model_dir)
    model = load_causal_lm(micro_model_dir, tokenizer, dtype="float32", device="cpu")
    batch = collate(rollouts(tokenizer), tokenizer.pad_token_id, torch.device("cpu"))
    results = []
    for dtype in ("none", "bfloat16"):
        model.zero_grad()
        with autocast(dtype, torch.device("cpu")):
            logprobs, _ = response_logprobs(model, batch, packed=path == "packed")
        (logprobs * batch.response_mask).sum().backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        results.append((logprobs.detach(), grads.clone()))
    (exact, exact_grad), (mixed, mixed_grad) = results
    mask = batch.response_mask.bool()
    assert torch.allclose(mixed[mask], exact[mask], atol=0.1)
    cosine = torch.nn.functional.cosine_similarity(exact_grad, mixed_grad, dim=0)
    assert cosine > 0.98 and torch.isfinite(mixed_grad).all()
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_a_run_trains_under_bf16_autocast(tmp_path, run_config, micro_model_dir, digit_reward):
    config = run_config(
        micro_model_dir,
        digit_reward,
        **{"trainer.autocast": "bfloat16", "trainer.total_steps": 3, "algorithm.kl_coef": 0.05},
    )
    train(config, tmp_path / "run", log=lambda m: None)
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    metrics = [json.loads(line) for line in lines]
    assert [m["step"] for m in metrics if m["step"] > 0] == [1, 2, 3]
    assert all(m.get("actor/skipped_updates", 0) == 0 for m in metrics)
