"""A policy written or read a tensor at a time (sharded, expert-parallel) goes through the
conversions ``save_pretrained`` and ``from_pretrained`` apply: its files are the ones
``save_pretrained`` writes, and they load back to the same tensors."""

import pytest
import torch
from safetensors.torch import load_file

from honing.models.loading import loaded_pieces, saved_pieces
from tests.models.moe_families import build
from tests.models.moe_models import moe_model


def _model(family: str):
    if family == "gpt_oss":  # fused in its checkpoints too: no conversion
        return build(family, vocab_size=64)
    return moe_model(family, 64, 0).float()


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"])
def test_pieces_are_what_save_pretrained_writes_and_load_back(tmp_path, family):
    model = _model(family)
    model.save_pretrained(tmp_path)
    files = {}
    for shard in tmp_path.glob("*.safetensors"):
        files |= load_file(shard)
    state = model.state_dict()
    saved = dict(saved_pieces(model, state.items()))
    tied = {k for k in saved.keys() - files.keys() if k.endswith("lm_head.weight")}
    assert saved.keys() - tied == files.keys()
    for name, tensor in files.items():
        assert torch.equal(saved[name], tensor), name
    # the files' tensors in the checkpoint's order, which mixes the experts of several layers
    loaded = dict(loaded_pieces(model, sorted(files.items(), reverse=True)))
    assert loaded.keys() == state.keys() - tied
    for name, tensor in loaded.items():
        assert torch.equal(tensor, state[name]), name


def test_a_converted_tensor_missing_a_piece_passes_its_pieces_on():
    """The caller's check of names then reports them as names the model lacks."""
    model = _model("qwen3_moe")
    pieces = dict(saved_pieces(model, model.state_dict().items()))
    gone = next(name for name in pieces if name.endswith(".experts.3.gate_proj.weight"))
    del pieces[gone]
    loaded = dict(loaded_pieces(model, pieces.items()))
    experts = gone.split(".3.")[0]  # model.layers.N.mlp.experts
    assert f"{experts}.gate_up_proj" not in loaded and f"{experts}.down_proj" in loaded
    assert torch.equal(loaded[f"{experts}.0.up_proj.weight"], pieces[f"{experts}.0.up_proj.weight"])
