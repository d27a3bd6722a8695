"""rollout.speculative=mtp: heads on the policy's hidden states learn online from the rollouts
(their loss falls), their state is checkpointed, and the engine speculates with them."""

import json

import torch

from honing.backends.launch import train

from ._configs import small_run_config


def test_mtp_heads_learn_online_and_are_checkpointed(tmp_path, micro_model_dir, digit_reward):
    config = small_run_config(
        micro_model_dir,
        digit_reward,
        **{
            "rollout.speculative": "mtp",
            "rollout.spec_tokens": 2,
            "rollout.spec_min_accept": 0.0,
            "rollout.max_new_tokens": 8,
            "rollout.mtp_lr": 1e-2,
            "trainer.total_steps": 12,
            "checkpoint.every": 12,
        },
    )
    train(config, tmp_path / "run", log=lambda m: None)
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    steps = [m for m in map(json.loads, lines) if m["step"] > 0]
    losses = [m["mtp/loss"] for m in steps]
    assert len(losses) == 12 and all(loss > 0 for loss in losses)
    assert all(m["timing_s/mtp"] > 0 for m in steps)
    assert all(0 <= m["rollout/spec_accept_rate"] <= 1 for m in steps)
    assert all(m["rollout/spec_enabled"] == 1.0 for m in steps)
    state = torch.load(
        tmp_path / "run" / "checkpoints" / "step_12" / "trainer_state.pt", weights_only=True
    )
    heads, optimizer = (state["trainers"]["mtp"][key] for key in ("module", "optimizer"))
    assert {key.split(".")[1] for key in heads} == {"0", "1"}
    assert optimizer["state"]


def test_the_heads_learn_what_follows_two_and_three_tokens_ahead(micro_model_dir):
    """On fixed sequences with a pattern, a few dozen steps of ``train_mtp`` take the heads'
    loss down and head 1 (two tokens ahead) to the pattern."""
    from honing.models.loading import load_causal_lm, load_tokenizer
    from honing.rollout.native.mtp import MtpHeads
    from honing.trainer.batch import collate
    from honing.trainer.engine import TrainedModule
    from honing.trainer.mtp import train_mtp
    from honing.types import Rollout

    tokenizer = load_tokenizer(micro_model_dir)
    policy = load_causal_lm(micro_model_dir, tokenizer, dtype="float32", device="cpu")
    rollouts = []
    for i in range(8):
        response = tokenizer.encode("1234" * 6)
        rollouts.append(
            Rollout(
                f"p{i}", i, tokenizer.encode(f"{i} + {i} ="), response, [0.0] * 24, "length", 0, ""
            )
        )
    batch = collate(rollouts, tokenizer.pad_token_id, torch.device("cpu"))
    heads = MtpHeads(policy.config.hidden_size, 2)
    optimizer = torch.optim.AdamW(heads.parameters(), lr=3e-2)
    generator = torch.Generator().manual_seed(0)
    engine = TrainedModule("mtp", heads, optimizer)
    history = [train_mtp(engine, policy, batch, generator) for _ in range(60)]
    assert history[-1]["mtp/loss"] < 0.3 * history[0]["mtp/loss"]
    assert history[-1]["mtp/accuracy"] > 0.9 > history[0]["mtp/accuracy"]
