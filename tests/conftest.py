"""Shared fixtures: a very small warm-started model and a reward with signal for it."""

from pathlib import Path

import pytest

from honing.data import warmstart_corpus
from honing.models.loading import load_tokenizer, save_model
from honing.models.tiny import TinySpec, build_tiny_model
from tests.models.moe_models import moe_model

MICRO_SPEC = TinySpec(
    hidden_size=32,
    num_layers=2,
    num_heads=2,
    intermediate_size=64,
    warmstart_steps=30,
    warmstart_batch=64,
)

# The micro model almost never answers an arithmetic problem correctly, so under the built-in
# reward every score is 0, every GRPO advantage is 0 and training would not move the weights.
# This graded reward varies within every group, so pipeline tests really train.
DIGIT_REWARD = '''
def digit_fraction(response, ground_truth, **context):
    """Fraction of the response's characters that are digits (0 for an empty response)."""
    return sum(c.isdigit() for c in response) / max(len(response), 1)
'''


@pytest.fixture(scope="session")
def micro_model_dir(tmp_path_factory) -> Path:
    """A ~20k-parameter Llama in Hugging Face format, with the built-in tiny tokenizer."""
    corpus = warmstart_corpus(1000, 0, 2, 0.6)
    return build_tiny_model(
        tmp_path_factory.mktemp("models"), corpus, MICRO_SPEC, log=lambda message: None
    )


@pytest.fixture(scope="session")
def digit_reward(tmp_path_factory) -> str:
    """A ``reward.function`` spec (``file.py:function``) for ``DIGIT_REWARD``."""
    path = tmp_path_factory.mktemp("rewards") / "digit_reward.py"
    path.write_text(DIGIT_REWARD)
    return f"{path}:digit_fraction"


@pytest.fixture
def run_config():
    """``small_run_config`` of the pipeline tests, for tests in other folders."""
    from pipeline._configs import small_run_config

    return small_run_config


@pytest.fixture(scope="session")
def moe_dirs(tmp_path_factory, micro_model_dir):
    """Model directories of small random MoE families with the micro model's tokenizer."""
    tokenizer = load_tokenizer(micro_model_dir)
    root = tmp_path_factory.mktemp("moe")
    dirs = {}
    for family in ("qwen3_moe", "mixtral", "deepseek_v3"):
        model = moe_model(family, len(tokenizer), tokenizer.pad_token_id)
        model.config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        save_model(model, tokenizer, root / family)
        dirs[family] = root / family
    return dirs
