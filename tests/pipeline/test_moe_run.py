"""Mixture-of-experts policies in whole runs: every family trains, routing replay and the
router losses under each schedule, the metrics they log, and what is refused up front."""

import json
from pathlib import Path

import pytest

from honing.backends.launch import train
from honing.config import build_config
from honing.errors import ConfigError
from honing.pipeline.rules import check_config
from tests.monitor.test_sinks import tensorboard_scalars

from ._configs import small_run_config


def step_metrics(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if '"actor/pg_loss"' in line]


QUICK = {"trainer.total_steps": 2, "trainer.val_at_start": False}


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_every_family_trains_with_its_routing_metrics(tmp_path, moe_dirs, digit_reward, family):
    overrides = {"algorithm.routing_replay": "R3", "monitor.tensorboard": True}
    config = small_run_config(moe_dirs[family], digit_reward, **QUICK | overrides)
    train(config, tmp_path / "run", log=lambda m: None)
    steps = step_metrics(tmp_path / "run")
    tags = tensorboard_scalars(tmp_path / "run" / "tensorboard")
    assert len(tags["moe/layer1/load_violation"]) == 2  # per layer, every step
    assert len(steps) == 2
    for step in steps:
        # the trainer's live routers agree with the engine's records, token for token (a
        # misaligned record would agree on few); >= 0.99: a near-tie may round the other
        # way on another CPU
        assert step["moe/rollout_router_match"] >= 0.99
        assert 0 <= step["moe/load_violation/mean"] <= step["moe/load_violation/max"]
        assert step["moe/router_entropy"] > 0
        assert "moe/layer0/load_violation" in step


@pytest.mark.parametrize("family", ["gpt_oss", "llama4_text", "granitemoe", "jamba", "dbrx"])
def test_families_beyond_the_gate_router_train_with_r3(tmp_path, moe_dirs, digit_reward, family):
    """Routers named ``router``, returning dense scores (Llama 4) or only logits (DBRX, whose
    block chooses), softmax over the top-k logits (gpt-oss, Granite): three steps with R3,
    the engine's records replayed, every moe/* metric logged."""
    values = QUICK | {"trainer.total_steps": 3, "algorithm.routing_replay": "R3"}
    train(small_run_config(moe_dirs[family], digit_reward, **values), tmp_path / "run")
    steps = step_metrics(tmp_path / "run")
    assert len(steps) == 3
    for step in steps:
        assert step["moe/rollout_router_match"] >= 0.99
        assert 0 <= step["moe/load_violation/mean"] <= step["moe/load_violation/max"]
        assert step["moe/router_entropy"] > 0


def test_a_family_replay_cannot_reproduce_is_refused_with_the_reason(moe_dirs, digit_reward):
    config = small_run_config(
        moe_dirs["phimoe"], digit_reward, **{"algorithm.routing_replay": "R3"}
    )
    with pytest.raises(ConfigError, match="the phimoe family routes with sparsemixer, .*; set"):
        train(config, Path("/nonexistent/run"), log=lambda m: None)


@pytest.mark.parametrize(
    "overrides",
    [
        {"schedule.mode": "one_step", "algorithm.routing_replay": "R3"},
        {"schedule.mode": "async", "algorithm.routing_replay": "R3"},
        {"algorithm.routing_replay": "R3", "rollout.speculative": "ngram"},
        {"algorithm.routing_replay": "R3", "rollout.speculative": "mtp"},
        {  # each sample's experts stitched across its chunks
            "schedule.mode": "async",
            "schedule.partial_rollout": True,
            "schedule.partial_chunk_tokens": 1,
            "algorithm.routing_replay": "R3",
        },
        {"algorithm.routing_replay": "R2", "trainer.ppo_epochs": 2},
        {"algorithm.router_aux_coef": 0.01, "algorithm.router_z_coef": 0.001},
        {"algorithm.routing_replay": "R3", "model.lora_rank": 4, "trainer.autocast": "bfloat16"},
    ],
    ids=[
        "one_step-R3",
        "async-R3",
        "ngram-R3",
        "mtp-R3",
        "partial-R3",
        "R2",
        "router-losses",
        "lora-bf16-R3",
    ],
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
        (
            {"rollout.engine": "openai", "rollout.endpoints": "http://127.0.0.1:9"}
            | {"rollout.speculative": "server"},
            "servers that speculate report no routed experts",
        ),
        ({"model.gradient_checkpointing": True}, "activation checkpointing"),
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


def test_the_documented_imbalance_alert_parses_and_fires():
    from pathlib import Path

    from honing.monitor.alerts import AlertRules, parse_rule

    docs = (Path(__file__).parents[2] / "docs" / "moe.md").read_text()
    [rule] = [line.strip()[3:-1] for line in docs.splitlines() if "load_violation/max >" in line]
    rules = AlertRules([parse_rule(rule)])
    fired = [rules.observe(step, {"moe/load_violation/max": 3.5}) for step in range(1, 6)]
    assert not any(fired[:4]) and fired[4]


@pytest.mark.slow
def test_two_sharded_ranks_replay_the_rollouts_experts(tmp_path, moe_dirs, digit_reward):
    """R3 under trainer.strategy=fsdp: two gloo ranks, each routing its rows as the rollout
    did, train what one process does."""
    from transformers import AutoModelForCausalLM

    from .test_data_parallel_run import assert_same_moves
    from .test_sharded_run import run

    args = (moe_dirs["qwen3_moe"], digit_reward)
    replay = {"algorithm.routing_replay": "R3"}
    padded = replay | {"trainer.packed_forward": False}  # the sharded ranks' arithmetic
    one, _, _ = run(tmp_path, "one", *args, 1, 1, strategy="replicate", **padded)
    two, _, _ = run(tmp_path, "two", *args, 2, 1, **replay)
    assert one[0]["critic/score/mean"] == two[0]["critic/score/mean"]  # the same samples
    assert all(m["moe/rollout_router_match"] >= 0.99 for m in one + two)
    assert abs(one[0]["actor/grad_norm"] - two[0]["actor/grad_norm"]) < 1e-5
    # (a later step's weights are no test: an update's last-bit differences flip some routing
    # decisions, and Adam turns a flipped sign of a tiny gradient into a step of lr)
    one_step, two_step = (
        AutoModelForCausalLM.from_pretrained(tmp_path / name / "checkpoints" / "step_1")
        for name in ("one", "two")
    )  # the sharded export loads as the model it is (experts in transformers' layout)
    before = AutoModelForCausalLM.from_pretrained(moe_dirs["qwen3_moe"]).state_dict()
    # rel 2e-2, not the dense suite's 1e-3: this random model's embedding rows of tokens seen
    # only in prompts get gradients near AdamW's eps (1e-8), where the last bits of a sum in
    # another order move the first step by a visible fraction of lr (seen: 1.0e-2 of the move)
    assert_same_moves(two_step.state_dict(), one_step.state_dict(), before, rel=2e-2)


@pytest.mark.slow
def test_generation_spread_over_ranks_carries_the_experts(tmp_path, moe_dirs, digit_reward):
    """Replicated ranks that each sample their share of the prompts hand their rollouts'
    experts to rank 0 with them: R3 replays what each rank's routers chose."""
    from .test_sharded_run import run

    spread = {"algorithm.routing_replay": "R3", "pipeline.spread_generation": True}
    args = (moe_dirs["qwen3_moe"], digit_reward)
    two, _, _ = run(tmp_path, "two", *args, 2, 2, strategy="replicate", **spread)
    assert len(two) == 2 and all(m["moe/rollout_router_match"] >= 0.99 for m in two)


def test_servers_that_return_no_routed_experts_are_refused_at_the_start():
    """A stand-in for a vLLM started without --enable-return-routed-experts (the path with
    honing's own server, which returns them, runs in tests/rollout/test_openai_engine.py)."""
    from honing.pipeline.rules import check_remote_routing
    from honing.types import Rollout

    class Server:
        def generate(self, requests, params):
            return [Rollout("p", 0, [5, 6], [7], [-0.1], "length", 0, "x")]

    config = build_config({"rollout.engine": "openai", "algorithm.routing_replay": "R3"})
    with pytest.raises(ConfigError, match="--enable-return-routed-experts"):
        check_remote_routing(config, Server(), [5, 6])


@pytest.mark.slow
def test_two_sharded_ranks_replay_their_old_pass_under_r2(tmp_path, moe_dirs, digit_reward):
    """R2 under fsdp: each rank records the old pass of its rows, the plan is gathered, and
    the update passes replay it: before the first optimizer step they route as one process
    does. (After it, Adam's first steps on near-zero gradients part the two runs' weights in
    the last bits.)"""
    from .test_sharded_run import run

    args = (moe_dirs["qwen3_moe"], digit_reward)
    r2 = {"algorithm.routing_replay": "R2", "trainer.ppo_epochs": 2}
    padded = r2 | {"trainer.packed_forward": False}
    one, _, _ = run(tmp_path, "one", *args, 1, 1, strategy="replicate", **padded)
    two, _, _ = run(tmp_path, "two", *args, 2, 1, **r2)
    assert one[0]["critic/score/mean"] == two[0]["critic/score/mean"]
    assert abs(one[0]["rollout_mismatch/kl"] - two[0]["rollout_mismatch/kl"]) < 1e-6
    # a misplaced row of the gathered plan moves the match by ~1e-2 (a rolled plan: 0.011);
    # 3e-3 leaves room for a near-tie that another thread count rounds the other way
    match = one[0]["moe/rollout_router_match"], two[0]["moe/rollout_router_match"]
    assert abs(match[0] - match[1]) < 3e-3, match
