"""model.gradient_checkpointing=true: activations recomputed in the backward pass, the same
training (the logprob passes leave the packed forward for the model's own, and say so)."""

import json

from honing.pipeline.components import build_components
from honing.pipeline.run import train

from ._configs import small_run_config


def step_metrics(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if '"actor/pg_loss"' in line]


def test_checkpointing_trains_as_without_it(tmp_path, micro_model_dir, digit_reward):
    common = {"trainer.total_steps": 3, "trainer.val_at_start": False, "algorithm.kl_coef": 0.1}
    logged = []
    config = small_run_config(
        micro_model_dir, digit_reward, **common | {"model.gradient_checkpointing": True}
    )
    parts = build_components(config, log=logged.append)
    assert parts.policy.is_activation_checkpointing
    assert any("gradient checkpointing is on" in line for line in logged), logged
    train(config, tmp_path / "ckpt", log=lambda m: None)
    train(
        small_run_config(micro_model_dir, digit_reward, **common),
        tmp_path / "plain",
        log=lambda m: None,
    )
    with_ckpt, plain = step_metrics(tmp_path / "ckpt"), step_metrics(tmp_path / "plain")
    assert len(with_ckpt) == len(plain) == 3
    for a, b in zip(with_ckpt, plain, strict=True):
        assert a["step"] == b["step"]
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/entropy"):
            assert abs(a[key] - b[key]) <= 1e-4 * max(1.0, abs(b[key])), (key, a[key], b[key])
