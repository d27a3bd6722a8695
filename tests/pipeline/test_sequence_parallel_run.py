"""``honing train`` under torchrun with ``trainer.sequence_parallel=2``: two CPU ranks share
every sequence (one data-parallel slot) through the whole loop (the reference's and the
update's passes, weight sync, checkpoints) and train the steps one process does."""

import pytest
import torch

from .test_data_parallel_run import COMPARED, PPO, assert_same_moves, initial_weights, train
from .test_sharded_run import LORA, run

SEQUENCE_PARALLEL = {"trainer.sequence_parallel": 2, "pipeline.spread_generation": False}


@pytest.mark.slow
def test_two_ranks_sharing_each_sequence_train_the_steps_one_process_does(
    tmp_path, micro_model_dir, digit_reward
):
    args = (micro_model_dir, digit_reward)
    one, one_weights = train(tmp_path, "one", *args, ranks=1, steps=2)
    two, two_weights = train(tmp_path, "two", *args, ranks=2, steps=2, **SEQUENCE_PARALLEL)
    assert len(one) == len(two) == 2
    for a, b in zip(one, two, strict=True):
        assert a["critic/score/mean"] == b["critic/score/mean"]  # the same batch
        assert b["perf/token_imbalance"] == 1.0  # one slot: both ranks ran every row
        assert 0 < b["memory/activation_peak_mb"] < a["memory/activation_peak_mb"]
        for key in COMPARED:
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    assert_same_moves(two_weights, one_weights, initial_weights(micro_model_dir))


@pytest.mark.slow
def test_four_fsdp_ranks_in_two_slots_train_with_activation_checkpointing(
    tmp_path, micro_model_dir, digit_reward
):
    """FSDP shards over all four ranks while each pair shares its slot's sequences, and the
    layers recompute their activations in the backward pass (the model's own forward, the
    Ulysses attention run again): the steps one process trains."""
    values = {"model.gradient_checkpointing": True, "algorithm.kl_coef": 0.05}
    args = (micro_model_dir, digit_reward)
    one, one_weights, _ = run(tmp_path, "one", *args, 1, 2, strategy="replicate", **values)
    four, four_weights, _ = run(tmp_path, "four", *args, 4, 2, "fsdp", **values | SEQUENCE_PARALLEL)
    for a, b in zip(one, four, strict=True):
        assert a["critic/score/mean"] == b["critic/score/mean"]
        for key in COMPARED:
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    assert four[0]["dist/world_size"] == 4
    assert_same_moves(four_weights, one_weights, initial_weights(micro_model_dir))


@pytest.mark.slow
def test_mtp_heads_learn_beside_ranks_sharing_each_sequence(
    tmp_path, micro_model_dir, digit_reward
):
    """rollout.speculative=mtp: rank 0's engine drafts with the heads and trains them on the
    updated policy's hidden states (its whole copy, plain attention), as one process does."""
    values = {
        "rollout.speculative": "mtp",
        "rollout.spec_tokens": 2,
        "rollout.spec_min_accept": 0.0,
        "rollout.mtp_lr": 1e-2,
    }
    args = (micro_model_dir, digit_reward)
    one, _, _ = run(tmp_path, "one", *args, 1, 2, strategy="replicate", **values)
    two, _, _ = run(tmp_path, "two", *args, 2, 2, "replicate", **values | SEQUENCE_PARALLEL)
    for a, b in zip(one, two, strict=True):
        assert a["critic/score/mean"] == b["critic/score/mean"]
        for key in ("mtp/loss", "mtp/accuracy", *COMPARED):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    assert one[1]["mtp/loss"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["one_step", "async"])
def test_the_schedules_that_generate_ahead_train_with_ranks_sharing_each_sequence(
    tmp_path, micro_model_dir, digit_reward, mode
):
    """Rank 0's producer generates ahead with its own copy of the policy (plain attention:
    the Ulysses attention runs only where a pass gives it the group) while both ranks train.
    one_step trains on what one process does (each batch from the weights one step
    behind); async's batches depend on how far the producer ran ahead, so only its first
    step (from the first weights) is compared, and its steps are all there."""
    values = {"schedule.mode": mode, "algorithm.kl_coef": 0.05}
    args = (micro_model_dir, digit_reward)
    one, _, _ = run(tmp_path, "one", *args, 1, 3, strategy="replicate", **values)
    two, _, _ = run(tmp_path, "two", *args, 2, 3, "replicate", **values | SEQUENCE_PARALLEL)
    assert [m["step"] for m in two] == [1, 2, 3]
    for a, b in zip(one, two if mode == "one_step" else two[:1], strict=False):
        assert a["critic/score/mean"] == b["critic/score/mean"]
        for key in ("rollout_mismatch/kl", *COMPARED):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    assert one[1]["rollout_mismatch/kl"] > 0  # the engine sampled with older weights


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["replicate", "fsdp"])
def test_ppo_with_a_critic_trains_with_ranks_sharing_each_sequence(
    tmp_path, micro_model_dir, digit_reward, strategy
):
    """algorithm.advantage=gae under SP: the critic's value pass and its fit run with each
    sequence shared by two ranks; the values, advantages and both losses are one process's
    (step 2's values are the critic fitted at step 1), and so are the policy's weights."""
    args = (micro_model_dir, digit_reward)
    one, one_weights, _ = run(tmp_path, "one", *args, 1, 2, strategy="replicate", **PPO)
    two, two_weights, _ = run(tmp_path, "two", *args, 2, 2, strategy, **PPO | SEQUENCE_PARALLEL)
    for a, b in zip(one, two, strict=True):
        assert a["critic/score/mean"] == b["critic/score/mean"]
        for key in ("critic/values/mean", "critic/grad_norm", "critic/advantages/mean", *COMPARED):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    assert one[1]["critic/vf_loss"] > 0 and one[1]["critic/values/mean"] != 0
    assert_same_moves(two_weights, one_weights, initial_weights(micro_model_dir))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["replicate", "fsdp"])
def test_lora_adapters_train_with_ranks_sharing_each_sequence(
    tmp_path, micro_model_dir, digit_reward, strategy
):
    """LoRA under SP: the adapters' update and the reference pass (the policy with its
    adapters off, for the KL loss) shared by two ranks, the packed forward (replicated) and
    the model's own inside the wrapper (FSDP), end where one process does."""
    values = LORA | {"algorithm.kl_coef": 0.05}
    args = (micro_model_dir, digit_reward)
    one, one_weights, _ = run(tmp_path, "one", *args, 1, 2, strategy="replicate", **values)
    two, two_weights, _ = run(tmp_path, "two", *args, 2, 2, strategy, **values | SEQUENCE_PARALLEL)
    for a, b in zip(one, two, strict=True):
        assert a["critic/score/mean"] == b["critic/score/mean"]
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    assert one[1]["actor/kl_loss"] > 0  # the reference pass mattered
    assert one_weights.keys() <= two_weights.keys()
    for name, want in one_weights.items():
        torch.testing.assert_close(two_weights[name], want, atol=1e-4, rtol=0)


R2 = {"algorithm.routing_replay": "R2", "trainer.ppo_epochs": 2}
ROUTER_LOSSES = {"algorithm.router_aux_coef": 0.01, "algorithm.router_z_coef": 0.001}


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy, ranks, values",
    [
        ("replicate", 2, R2 | ROUTER_LOSSES),
        ("replicate", 2, {"algorithm.routing_replay": "R3", "trainer.ppo_epochs": 2}),
        ("fsdp", 2, R2 | ROUTER_LOSSES | {"trainer.packed_forward": False}),
        # two slots: their micro-batches are not one process's, and what depends on the split
        # (the router losses of each micro-batch, the packed stream's prompts counted once
        # per micro-batch) differs as under data parallelism without SP
        ("replicate", 4, R2 | {"trainer.packed_forward": False}),
    ],
    ids=["replicate-2", "replicate-2-R3", "fsdp-2", "replicate-4"],
)
def test_an_moe_policy_replays_its_routing_with_ranks_sharing_each_sequence(
    tmp_path, moe_dirs, digit_reward, strategy, ranks, values
):
    """A Qwen3-MoE policy under R2 (with the router losses): the ranks sharing each sequence
    (two; four ranks are two data-parallel slots of two) record the old pass's experts, the
    slots' records are gathered and replayed in both PPO epochs, and the router losses and
    statistics are over every token, as one process's. (FSDP's ranks run the model's own
    forward: the one process does too.) Under R3 each rank replays its slice of the
    rollout's experts."""
    args = (moe_dirs["qwen3_moe"], digit_reward)
    one, _, _ = run(tmp_path, "one", *args, 1, 1, strategy="replicate", **values)
    two, _, _ = run(tmp_path, "two", *args, ranks, 1, strategy, **values | SEQUENCE_PARALLEL)
    [a], [b] = one, two
    assert a["critic/score/mean"] == b["critic/score/mean"]  # the same samples
    compared = ["rollout_mismatch/kl", "actor/pg_loss", "actor/grad_norm", "actor/kl_loss"]
    compared += ["moe/aux_loss", "moe/z_loss"] if "algorithm.router_aux_coef" in values else []
    for key in compared:
        assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    # statistics of the first optimizer step's passes, over every real token: the match of the
    # replayed choice with the rollout's and the loads move by ~1e-1 when a rank's tokens are
    # counted twice or not at all; 3e-3 leaves room for a near-tie rounded the other way
    for key in ("moe/rollout_router_match", "moe/load_violation/max", "moe/router_entropy"):
        assert abs(b[key] - a[key]) < 3e-3, (key, a[key], b[key])
