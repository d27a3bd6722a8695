"""Training through vLLM in process (``rollout.engine=vllm``), for real: the weights reach
vLLM after every update and after a resume, which the engine/trainer gap logged every step
shows (``rollout_mismatch/*``), and the settings it cannot honour are refused in one line."""

from __future__ import annotations

import json
import sys

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]')")

from honing.backends.launch import train  # noqa: E402
from honing.errors import ConfigError  # noqa: E402
from honing.pipeline.rules import check_config  # noqa: E402

from ._configs import small_run_config  # noqa: E402

pytestmark = pytest.mark.slow

NO_LOG = lambda message: None  # noqa: E731
# fp32 on both sides: the trainer's and vLLM's logprobs of the same tokens differ by the
# rounding of other kernels (~1e-6 nats measured); a version vLLM did not get is off by far
# more at this learning rate (0.02-0.2 nats after one step)
GAP = 1e-3
VLLM = {
    "rollout.engine": "vllm",
    "rollout.vllm_kv_cache_mb": 16,
    "rollout.max_seq_len": 64,
    "rollout.temperature": 0.8,
    "trainer.lr": 3e-3,
    "trainer.val_at_start": False,
    "data.train_size": 60,
}


def _steps(run_dir) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").open()
    return [m for m in map(json.loads, lines) if "samples/generated" in m]


def test_every_step_logs_the_gap_and_vllm_follows_the_updates_and_a_resume(
    tmp_path, vllm_model_dir, digit_reward
):
    run = tmp_path / "run"
    first = small_run_config(
        vllm_model_dir, digit_reward, **VLLM | {"trainer.total_steps": 2, "checkpoint.every": 2}
    )
    train(first, run, resume="never", log=NO_LOG)
    # A resume loads step 2's checkpoint and hands its weights to a new vLLM engine, which
    # starts from the model directory's: step 3 must sample with step 2's weights.
    more = small_run_config(
        vllm_model_dir, digit_reward, **VLLM | {"trainer.total_steps": 3, "checkpoint.every": 2}
    )
    train(more, run, resume="auto", log=NO_LOG)
    steps = _steps(run)
    assert [m["step"] for m in steps] == [1, 2, 3]
    for m in steps:
        assert m["rollout_mismatch/logprob_diff_max"] < GAP, m
        assert m["rollout_mismatch/kl"] < 1e-6, m
        assert m["perf/sync_mb"] > 0
        assert m["actor/grad_norm"] > 0


def test_a_lora_policy_reaches_vllm_merged(tmp_path, vllm_model_dir, digit_reward):
    """vLLM holds a plain model: each update's adapters arrive merged into the base weights
    (at this learning rate the adapters move the logprobs by far more than the gap)."""
    config = small_run_config(
        vllm_model_dir,
        digit_reward,
        **VLLM | {"trainer.total_steps": 3, "model.lora_rank": 4, "trainer.lr": 3e-2},
    )
    train(config, tmp_path / "run", resume="never", log=NO_LOG)
    steps = _steps(tmp_path / "run")
    assert len(steps) == 3
    assert all(m["rollout_mismatch/logprob_diff_max"] < GAP for m in steps), steps


def test_embeddings_grown_for_a_pad_token_reach_vllm(tmp_path, vllm_model_dir, digit_reward):
    """A tokenizer without a pad token gets one and the policy an embedding row more than its
    directory holds: vLLM is built for the grown vocabulary and given the policy's weights."""
    from honing.models.loading import load_causal_lm, load_tokenizer, save_model

    tokenizer = load_tokenizer(vllm_model_dir)
    model = load_causal_lm(vllm_model_dir, tokenizer, dtype="float32", device=torch.device("cpu"))
    tokenizer.pad_token = tokenizer.eos_token  # as many base models ship: no pad token
    save_model(model, tokenizer, tmp_path / "no-pad")
    # and a rollout.max_seq_len past the model's 64 positions, which vLLM would refuse
    overrides = VLLM | {"trainer.total_steps": 2, "rollout.max_seq_len": 512}
    config = small_run_config(tmp_path / "no-pad", digit_reward, **overrides)
    train(config, tmp_path / "run", resume="never", log=NO_LOG)
    steps = _steps(tmp_path / "run")
    assert len(steps) == 2
    assert all(m["rollout_mismatch/logprob_diff_max"] < GAP for m in steps), steps


def test_what_vllm_cannot_do_is_refused_in_one_line(vllm_model_dir, micro_model_dir, tmp_path):
    def refused(model_dir, world_size=1, **overrides):
        config = small_run_config(model_dir, "auto", **{"rollout.engine": "vllm"} | overrides)
        with pytest.raises(ConfigError) as caught:
            check_config(config, world_size)
            train(config, tmp_path / "run", resume="never", log=NO_LOG)
        return str(caught.value)

    assert "rollout.gen_timeout_s" in refused(vllm_model_dir, **{"rollout.gen_timeout_s": 5.0})
    assert "rollout.speculative" in refused(vllm_model_dir, **{"rollout.speculative": "ngram"})
    assert "R3" in refused(vllm_model_dir, **{"algorithm.routing_replay": "R3"})
    # the micro model's head size (16) has no kernel in vLLM's CPU attention
    assert "head sizes" in refused(micro_model_dir)


def test_a_family_whose_weight_names_vllm_does_not_map_is_one_line(tmp_path, digit_reward):
    """transformers renames Mixtral's block_sparse_moe to mlp when it loads, which vLLM's
    Mixtral does not map back: a ConfigError naming the engine to use, before any step."""
    from honing.models.loading import save_model
    from honing.models.tiny import build_tokenizer
    from tests.models.moe_models import moe_model

    tokenizer = build_tokenizer()
    heads = {"hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 2}
    model = moe_model("mixtral", len(tokenizer), tokenizer.pad_token_id, **heads)
    save_model(model, tokenizer, tmp_path / "mixtral")
    config = small_run_config(tmp_path / "mixtral", digit_reward, **VLLM)
    with pytest.raises(ConfigError) as caught:
        train(config, tmp_path / "run", resume="never", log=NO_LOG)
    message = str(caught.value)
    assert "\n" not in message and message.endswith("use rollout.engine=transformers"), message


def test_without_vllm_the_engine_is_one_line_naming_the_extra(
    tmp_path, vllm_model_dir, monkeypatch
):
    from tests.test_cli import error_line, run_train

    monkeypatch.setitem(sys.modules, "vllm", None)  # what an environment without it imports
    result = run_train(tmp_path, f"model.path={vllm_model_dir}", "rollout.engine=vllm")
    assert '".[vllm]"' in error_line(result)


def test_partial_rollouts_continue_samples_in_vllm_beside_the_trainer(
    tmp_path, vllm_model_dir, digit_reward
):
    """async with partial rollouts keeping the samples' caches: the producer's thread
    generates through vLLM in chunks while the trainer's thread trains (trainer.threads=1, so
    the two threads' OpenMP settings differ: vLLM's CPU attention refused such a thread until
    the engine gave each thread the count it was built with). Every sample is accounted
    for, and continued samples went on from their kept vLLM requests."""
    values = VLLM | {
        "schedule.mode": "async",
        "schedule.max_staleness": 2,
        "schedule.partial_rollout": True,
        "schedule.partial_chunk_tokens": 2,
        "schedule.partial_kv": "keep",
        "rollout.max_new_tokens": 8,
        "trainer.threads": 1,
        "trainer.total_steps": 4,
    }
    run = tmp_path / "run"
    train(small_run_config(vllm_model_dir, digit_reward, **values), run, resume="never", log=NO_LOG)
    steps = _steps(run)
    assert [m["step"] for m in steps] == [1, 2, 3, 4]
    for m in steps:
        accounted = ("samples/trained", "samples/filtered", "samples/failed", "samples/stale")
        assert m["samples/generated"] == 6 == sum(m[k] for k in accounted)
        assert "partial/carried_samples" in m
    assert sum(m.get("partial/kv_kept_tokens", 0) for m in steps) > 0
