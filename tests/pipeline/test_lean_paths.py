"""When a lean path does not apply (the packed logprob forward under gradient checkpointing, both
fast paths for a non-Llama model), the run trains as it would otherwise and says why."""

import json

from honing.backends.launch import train
from honing.models.loading import activation_checkpointing
from honing.pipeline.components import build_components

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
    assert activation_checkpointing(parts.policy)
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


def test_a_non_llama_policy_trains_and_says_which_lean_paths_it_skips(
    tmp_path, micro_model_dir, digit_reward
):
    from honing.models.loading import load_tokenizer, save_model
    from tests.rollout.test_fast_decode import gpt2

    tokenizer = load_tokenizer(micro_model_dir)
    model = gpt2(tokenizer)
    model.config.pad_token_id = tokenizer.pad_token_id
    save_model(model, tokenizer, tmp_path / "gpt2")
    config = small_run_config(
        tmp_path / "gpt2", digit_reward, **{"trainer.total_steps": 2, "trainer.val_at_start": False}
    )
    logged = []
    train(config, tmp_path / "run", log=logged.append)
    for key in ("rollout.fast_decode", "trainer.packed_forward"):
        assert any(line.startswith(key) and "not Llama-family" in line for line in logged), logged
    assert len(step_metrics(tmp_path / "run")) == 2
