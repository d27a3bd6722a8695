"""The trainer engine's weights for the rollout engines (``TrainedModule.weights``): each
tensor once, a head tied to the embeddings included (every engine ties it again from the
model's config), bucket by bucket."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from honing.trainer.engine import TrainedModule


def _model(tied: bool) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _sent(model) -> dict[str, torch.Tensor]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = TrainedModule("policy", model, optimizer)
    trainer.bucket_bytes = 4096  # several buckets
    return {name: tensor for bucket in trainer.weights() for name, tensor in bucket}


def test_a_tied_head_is_sent_once():
    tied = _model(tied=True)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    sent = _sent(tied)
    state = tied.state_dict()
    assert "lm_head.weight" in state and "lm_head.weight" not in sent
    assert sent.keys() == state.keys() - {"lm_head.weight"}
    for name, tensor in sent.items():
        assert torch.equal(tensor, state[name])
    shared = tied.model.embed_tokens.weight
    assert (
        sum(t.numel() for t in sent.values())
        == sum(t.numel() for n, t in state.items() if n != "lm_head.weight")
        == sum(p.numel() for p in tied.parameters())
    )  # parameters() counts it once too
    assert sent["model.embed_tokens.weight"].data_ptr() == shared.data_ptr()


def test_an_untied_head_is_sent_with_the_rest():
    untied = _model(tied=False)
    assert _sent(untied).keys() == untied.state_dict().keys()
