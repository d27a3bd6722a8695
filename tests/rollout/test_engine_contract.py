"""The rollout-engine seam (``rollout/base.py``): what an engine must have, checked when it is
built, and what it holds, said by one constructor argument."""

import pytest
import torch

from honing.rollout.base import Holding, RolloutEngine
from honing.rollout.native.engine import TransformersEngine


def test_an_engine_without_a_required_method_fails_when_built():
    class Forgetful(RolloutEngine):  # no generate
        def load_weights(self, version, weights=None):
            self.weight_version = version

        def detached_copy(self):
            return self

    with pytest.raises(TypeError, match="generate"):
        Forgetful(Holding.COPY)


def test_what_an_engine_holds_is_its_constructor_argument(micro_model_dir):
    from honing.models.loading import load_causal_lm, load_tokenizer

    tokenizer = load_tokenizer(micro_model_dir)
    model = load_causal_lm(micro_model_dir, tokenizer, dtype="float32", device="cpu")
    shared = TransformersEngine(model, tokenizer, device=torch.device("cpu"), holds=Holding.SHARED)
    assert shared.holds is Holding.SHARED and shared.weight_version == 0
    shared.weight_version = 3
    copy = shared.detached_copy()  # another thread's: its own module, which takes weights
    assert copy.holds is Holding.COPY and copy.model is not model and copy.weight_version == 3
    with pytest.raises(ValueError, match="in this process"):
        TransformersEngine(model, tokenizer, device=torch.device("cpu"), holds=Holding.REMOTE)
