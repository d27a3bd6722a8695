"""``rollout.engine=auto``: vLLM in process where it is installed, takes the run's settings
and is the faster engine for the model's size; honing's own engine otherwise."""

from __future__ import annotations

import importlib.util

import pytest

from honing.config import build_config
from honing.pipeline import rollout_engines as engine_choice
from honing.pipeline.rollout_engines import VLLM_FROM_PARAMETERS, choose_engine

needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"
)


@pytest.fixture(scope="module")
def large_config_dir(tmp_path_factory):
    """A model directory with only the config of a ~57M-parameter Llama (no weights: the
    choice reads the config alone)."""
    from transformers import LlamaConfig

    directory = tmp_path_factory.mktemp("large")
    LlamaConfig(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
    ).save_pretrained(directory)
    return directory


@pytest.fixture
def on_cuda(monkeypatch):
    """The choice as it is made on a GPU machine (the policy's device is CUDA)."""
    monkeypatch.setattr(engine_choice, "device_type", lambda config: "cuda")


def _chosen(path, world_size=1, **overrides):
    said = []
    config = build_config({"model.path": str(path)} | overrides)
    chosen = choose_engine(config, world_size, log=said.append)
    return chosen.rollout.engine, said


def test_the_builtin_model_is_honing_s(large_config_dir):
    engine, said = _chosen("builtin:tiny")
    assert engine == "transformers" and said == []  # the default path says nothing
    assert engine_choice.parameters(build_config({"model.path": str(large_config_dir)})) > (
        VLLM_FROM_PARAMETERS
    )


@needs_vllm
def test_on_a_cpu_a_large_model_with_one_optimizer_step_is_vllm_s(large_config_dir):
    """The update's forward gives the engine/trainer gap: a step with vLLM costs no logprob
    pass, and vLLM generates faster from 20M (benchmarks/results/vllm_step.md)."""
    engine, said = _chosen(large_config_dir, **{"model.device": "cpu"})
    assert engine == "vllm"
    assert said == [
        "rollout.engine=auto: vllm (57M parameters: vLLM pays from 20M "
        "(benchmarks/results/vllm_step.md))"
    ]


@needs_vllm
@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"trainer.ppo_epochs": 2}, "several optimizer steps per batch"),
        ({"trainer.mini_batch_size": 4}, "several optimizer steps per batch"),
        ({"algorithm.kl_in_reward": True, "algorithm.kl_coef": 0.1}, "the KL in the reward"),
    ],
)
def test_on_a_cpu_a_separate_logprob_pass_keeps_honing_s_engine(
    large_config_dir, overrides, reason
):
    """Where the trainer would weigh each batch in a pass of its own, honing's engine (which
    shares the policy and needs none) trains faster per step on a CPU."""
    engine, said = _chosen(large_config_dir, **{"model.device": "cpu"} | overrides)
    assert engine == "transformers"
    assert said[0].startswith(f"rollout.engine=auto: transformers (57M parameters; with {reason}")


def test_one_optimizer_step_per_batch_needs_no_logprob_pass():
    config = build_config({"rollout.batch_size": 4, "trainer.mini_batch_size": 4})
    assert engine_choice.logprob_pass(config) == ""
    assert engine_choice.logprob_pass(build_config({"trainer.mini_batch_size": 15})) != ""


@needs_vllm
def test_on_a_gpu_a_large_model_is_vllm_s(large_config_dir, on_cuda):
    engine, said = _chosen(large_config_dir)
    assert engine == "vllm"
    assert said == [
        "rollout.engine=auto: vllm (57M parameters: vLLM pays from 20M "
        "(benchmarks/results/vllm_step.md))"
    ]


@pytest.mark.parametrize(
    ("overrides", "world_size", "reason"),
    [
        ({"rollout.speculative": "ngram"}, 1, "rollout.speculative applies to honing's"),
        ({"rollout.gen_timeout_s": 5.0}, 1, "rollout.gen_timeout_s"),
        ({"algorithm.routing_replay": "R3"}, 1, "R3"),
        ({"rollout.vllm_sleep": True, "schedule.mode": "async"}, 1, "vllm_sleep"),
    ],
)
def test_settings_vllm_cannot_take_keep_honing_s_engine(
    large_config_dir, on_cuda, overrides, world_size, reason
):
    """What vLLM in process cannot take is the rules' to say: the choice quotes them."""
    engine, said = _chosen(large_config_dir, world_size, **overrides)
    assert engine == "transformers"
    assert "vLLM in process does not take this run: " in said[0] and reason in said[0]


@needs_vllm
@pytest.mark.parametrize(
    ("ranks", "overrides"),
    [
        (2, {"trainer.strategy": "replicate"}),
        (2, {"trainer.strategy": "fsdp"}),
        (1, {"pipeline.backend": "ray"}),
    ],
)
def test_ranks_and_ray_workers_on_gpus_take_vllm(large_config_dir, on_cuda, ranks, overrides):
    """vLLM in every torchrun rank, or in every Ray rollout worker."""
    engine, said = _chosen(large_config_dir, ranks, **overrides)
    assert engine == "vllm", said


def test_without_vllm_installed_honing_s_engine_is_chosen(large_config_dir, on_cuda, monkeypatch):
    monkeypatch.setattr(engine_choice.importlib.util, "find_spec", lambda name: None)
    engine, said = _chosen(large_config_dir)
    assert engine == "transformers" and ".[vllm]" in said[0]


def test_an_explicit_engine_is_kept(large_config_dir):
    for engine in ("transformers", "vllm", "openai"):
        config = build_config({"model.path": str(large_config_dir), "rollout.engine": engine})
        assert choose_engine(config, log=print) is config
