"""Ulysses sequence parallelism: two gloo ranks spawned once share each sequence, and their
logprobs, loss and summed gradients are one process's (the model's own forward).

Tolerance: float32 throughout; the ranks' projections run on half the rows (other matmul
blockings), attention runs the same sums in another order, and the parameter gradients are
sums of two ranks' parts, so agreement is to float32 reassociation (~1e-6 relative), not
bit for bit."""

import random
from dataclasses import replace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from honing.algorithms import logprobs_from_logits
from honing.trainer.batch import collate, response_logprobs
from honing.trainer.memory import saved_bytes
from honing.trainer.packed import packed_layout
from honing.trainer.ulysses.packed import packed_sequence_parallel_logprobs
from honing.trainer.ulysses.parallel import (
    SequenceGroup,
    check_model,
    next_token_logprobs,
    sequence_parallel_logprobs,
    use_ulysses,
)
from honing.types import Rollout
from tests.models.moe_models import moe_model
from tests.trainer.ranks import on_ranks

WORLD = 2
VOCAB = 64
PAD = 0
PACKED = (37, 26)  # two sequences in one row: 63 tokens, padded to 64 for two ranks
LONG = 2048  # the activation-memory sequence


def _llama(seed: int = 0, **overrides) -> LlamaForCausalLM:
    """A random Llama with grouped-query attention: 4 heads over 1 KV head (repeated for 2
    ranks)."""
    settings = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "max_position_embeddings": LONG,
        "pad_token_id": PAD,
        "tie_word_embeddings": False,
    }
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**settings | overrides)).float().eval()
    model.set_attn_implementation("sdpa")
    return model


def _model(case: str):
    if case == "moe":
        return moe_model("qwen3_moe", VOCAB, PAD).float()
    model = _llama()
    if case == "checkpointing":
        model.gradient_checkpointing_enable()
        model.train()
    return model


def _batch(long_answer: bool = False):
    """Rows of ~100 tokens: left-padded prompts (40 and 33), responses (60 and 45), and a third
    row sharing the first's prompt (the packed stream runs it once), with 30 response tokens
    (the packed forward's shared blocks) or ``long_answer`` 90 (a causal block per row)."""
    rng = random.Random(0)
    rollouts = [
        Rollout(
            prompt_id=f"p{i}",
            group_index=i,
            prompt_ids=[rng.randrange(1, VOCAB) for _ in range(prompt)],
            response_ids=[rng.randrange(1, VOCAB) for _ in range(response)],
            behaviour_logprobs=[-1.0] * response,
            finish_reason="length",
            weight_version=0,
            text="",
        )
        for i, (prompt, response) in enumerate([(40, 60), (33, 45)])
    ]
    response = rollouts[0].response_ids[:30]
    if long_answer:
        response = rollouts[0].response_ids + [rng.randrange(1, VOCAB) for _ in range(30)]
    rollouts.append(
        replace(rollouts[0], response_ids=response, behaviour_logprobs=[-1.0] * len(response))
    )
    return collate(rollouts, pad_id=PAD, device=torch.device("cpu"))


def _batch_loss(logprobs, entropy, batch):
    """A per-sequence mean (whole rows needed) and a token-mean entropy bonus."""
    mask = batch.response_mask
    weights = torch.linspace(-1.0, 1.0, mask.shape[1])
    per_row = (logprobs * weights * mask).sum(-1) / mask.sum(-1)
    return -per_row.mean() - 0.01 * (entropy * mask).sum() / mask.sum()


def _packed_row():
    """ids, positions (restarting at each sequence) and the scored columns (each sequence's
    tokens but its last) of one row of two sequences."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(1, VOCAB, (1, sum(PACKED)), generator=gen)
    positions = torch.cat([torch.arange(length) for length in PACKED])[None]
    scored = torch.ones_like(ids, dtype=torch.bool)
    scored[0, PACKED[0] - 1] = scored[0, -1] = False
    return ids, positions, scored


def _packed_loss(logprobs, scored):
    return -(logprobs * torch.linspace(0.5, 1.5, logprobs.shape[1]) * scored).sum()


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _sp_case(case: str, sp: SequenceGroup) -> dict:
    model = use_ulysses(_model(case), sp.world)
    if case == "packed":
        ids, positions, scored = _packed_row()
        logprobs, _ = next_token_logprobs(model, sp, ids, positions, scored)
        loss = _packed_loss(logprobs, scored)
        entropy = None
    else:
        batch = _batch(case == "stream-long")
        logprobs_of = (
            packed_sequence_parallel_logprobs
            if case.startswith("stream")
            else sequence_parallel_logprobs
        )
        logprobs, entropy = logprobs_of(model, batch, sp, with_entropy=True, entropy_grad=True)
        loss = _batch_loss(logprobs, entropy, batch)
    loss.backward()
    return {"logprobs": logprobs.detach(), "entropy": entropy, "loss": loss.detach()} | {
        "grads": _grads(model)
    }


def _one_process_case(case: str) -> dict:
    """The model's own forward: honing's ``response_logprobs`` (for the packed stream too),
    or its logits for the packed row (transformers reads the restarting positions as two
    sequences)."""
    model = _model(case)
    if case == "packed":
        ids, positions, scored = _packed_row()
        logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        logprobs = torch.zeros(ids.shape)
        logprobs[:, :-1] = logprobs_from_logits(logits[:, :-1], ids[:, 1:])
        logprobs = logprobs * scored
        loss, entropy = _packed_loss(logprobs, scored), None
    else:
        batch = _batch(case == "stream-long")
        logprobs, entropy = response_logprobs(model, batch, with_entropy=True, entropy_grad=True)
        logprobs, entropy = logprobs * batch.response_mask, entropy * batch.response_mask
        loss = _batch_loss(logprobs, entropy, batch)
    loss.backward()
    return {"logprobs": logprobs.detach(), "entropy": entropy, "loss": loss.detach()} | {
        "grads": _grads(model)
    }


def _long_saved_bytes(sp: SequenceGroup) -> int:
    """Bytes saved for backward by the logprob pass of one LONG-token sequence on this rank."""
    model = use_ulysses(_llama(hidden_size=64, intermediate_size=128), sp.world)
    ids = torch.randint(1, VOCAB, (1, LONG), generator=torch.Generator().manual_seed(4))
    positions = torch.arange(LONG)[None]
    with saved_bytes(model.parameters()) as saved:
        next_token_logprobs(model, sp, ids, positions, torch.ones_like(ids, dtype=torch.bool))
    return saved.bytes


CASES = ("batch", "packed", "checkpointing", "moe", "stream", "stream-long")


def test_the_stream_cases_take_both_packed_layouts():
    assert not packed_layout(_batch(), torch.device("cpu"), torch.float32).causal
    assert packed_layout(_batch(long_answer=True), torch.device("cpu"), torch.float32).causal


def _all_cases() -> dict:
    sp = SequenceGroup.of()
    results = {case: _sp_case(case, sp) for case in CASES}
    results["saved_bytes"] = _long_saved_bytes(sp)
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return on_ranks(_all_cases, str(tmp_path_factory.mktemp("sp") / "rank"), WORLD)


@pytest.mark.slow  # gloo ranks spawned, each importing torch
@pytest.mark.parametrize("case", CASES)
def test_two_ranks_sharing_a_sequence_compute_what_one_process_does(ranks, case):
    want = _one_process_case(case)
    for rank in ranks:
        got = rank[case]
        torch.testing.assert_close(got["logprobs"], want["logprobs"], atol=1e-5, rtol=1e-5)
        if want["entropy"] is not None:
            torch.testing.assert_close(got["entropy"], want["entropy"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got["loss"], want["loss"], atol=1e-6, rtol=1e-5)
    assert want["grads"].keys() == ranks[0][case]["grads"].keys()
    for name, grad in want["grads"].items():
        parts = [rank[case]["grads"][name] for rank in ranks]
        assert all(part.abs().max() > 0 for part in parts), name  # both ranks contribute
        torch.testing.assert_close(sum(parts), grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.slow
def test_each_rank_keeps_about_half_the_activations(ranks):
    one_process = _long_saved_bytes(SequenceGroup.alone())
    per_rank = [rank["saved_bytes"] for rank in ranks]
    print(f"saved for backward, {LONG} tokens: one process {one_process}, per rank {per_rank}")
    assert max(per_rank) <= 0.55 * one_process


def test_heads_the_ranks_do_not_divide_are_refused():
    with pytest.raises(ValueError, match="num_attention_heads=3 cannot be split over 2"):
        check_model(_llama(hidden_size=24, num_attention_heads=3), WORLD)
    with pytest.raises(ValueError, match="not sliding windows"):
        check_model(_llama(sliding_window=16, layer_types=["sliding_attention"] * 2), WORLD)
    check_model(_llama(), WORLD)  # 4 heads over 1 KV head: the KV head is repeated
