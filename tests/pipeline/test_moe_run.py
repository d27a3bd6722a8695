"""Mixture-of-experts policies in whole runs: every family trains, routing replay and the
router losses under each schedule, the metrics they log, and what is refused up front."""

import json

import pytest

from honing.backends.launch import train
from honing.config import build_config
from honing.errors import ConfigError
from honing.models.loading import load_tokenizer, save_model
from honing.pipeline.rules import check_config
from tests.models.moe_models import moe_model

from ._configs import small_run_config


@pytest.fixture(scope="module")
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


def step_metrics(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if '"actor/pg_loss"' in line]


QUICK = {"trainer.total_steps": 2, "trainer.val_at_start": False}


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_every_family_trains_with_its_routing_metrics(tmp_path, moe_dirs, digit_reward, family):
    config = small_run_config(
        moe_dirs[family], digit_reward, **QUICK | {"algorithm.routing_replay": "R3"}
    )
    train(config, tmp_path / "run", log=lambda m: None)
    steps = step_metrics(tmp_path / "run")
    assert len(steps) == 2
    for step in steps:
        assert step["moe/rollout_router_match"] == 1.0  # replayed: the rollout's own choice
        assert 0 <= step["moe/load_violation/mean"] <= step["moe/load_violation/max"]
        assert step["moe/router_entropy"] > 0
        assert "moe/layer0/load_violation" in step


@pytest.mark.parametrize(
    "overrides",
    [
        {"schedule.mode": "one_step", "algorithm.routing_replay": "R3"},
        {"algorithm.routing_replay": "R2", "trainer.ppo_epochs": 2},
        {"algorithm.router_aux_coef": 0.01, "algorithm.router_z_coef": 0.001},
        {"algorithm.routing_replay": "R3", "model.lora_rank": 4, "trainer.autocast": "bfloat16"},
    ],
    ids=["one_step-R3", "R2", "router-losses", "lora-bf16-R3"],
)
def test_replay_and_router_losses_train(tmp_path, moe_dirs, digit_reward, overrides):
    values = QUICK | overrides
    if "model.lora_rank" in values:
        values["model.lora_target_modules"] = ["q_proj", "v_proj"]
    config = small_run_config(moe_dirs["qwen3_moe"], digit_reward, **values)
    train(config, tmp_path / "run", log=lambda m: None)
    steps = step_metrics(tmp_path / "run")
    assert len(steps) == 2
    if "algorithm.router_aux_coef" in overrides:
        assert all(step["moe/aux_loss"] > 0 and step["moe/z_loss"] > 0 for step in steps)
    assert all(0 < step["moe/rollout_router_match"] <= 1 for step in steps)


def test_yaml_off_reads_as_off():
    assert build_config({"algorithm.routing_replay": False}).algorithm.routing_replay == "off"


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"rollout.speculative": "ngram"}, "speculative decoding records no routed experts"),
        ({"model.gradient_checkpointing": True}, "activation checkpointing"),
        ({"trainer.strategy": "fsdp", "algorithm.routing_replay": "R2"}, "fsdp"),
    ],
)
def test_combinations_replay_cannot_take_are_refused(overrides, message):
    config = build_config({"algorithm.routing_replay": "R3"} | overrides)
    with pytest.raises(ConfigError, match=message):
        check_config(config)


def test_replay_on_a_dense_policy_is_one_clear_error(tmp_path, micro_model_dir, digit_reward):
    config = small_run_config(micro_model_dir, digit_reward, **{"algorithm.routing_replay": "R3"})
    with pytest.raises(ConfigError, match="no top-k routed MoE layers"):
        train(config, tmp_path / "run", log=lambda m: None)


def test_an_aux_loss_the_family_lacks_is_one_clear_error(tmp_path, moe_dirs, digit_reward):
    config = small_run_config(
        moe_dirs["deepseek_v3"], digit_reward, **{"algorithm.router_aux_coef": 0.01}
    )
    with pytest.raises(ConfigError, match="defines no load-balancing loss"):
        train(config, tmp_path / "run", log=lambda m: None)
