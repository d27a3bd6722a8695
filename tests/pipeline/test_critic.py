"""PPO with a critic (gae): values, the critic's update, its metrics, and exact resume."""

import json
import math

import torch

from honing.backends.launch import train

from ._configs import small_run_config

NO_LOG = lambda message: None  # noqa: E731


def config(model_dir, reward, **overrides):
    specific = {
        "trainer.total_steps": 4,
        "trainer.lr": 5e-3,
        "trainer.critic_lr": 5e-3,
        "algorithm.advantage": "gae",
        "algorithm.gamma": 1.0,
        "algorithm.lam": 0.95,
        "checkpoint.every": 1,
        "checkpoint.keep": 10,
    }
    return small_run_config(model_dir, reward, **specific | overrides)


def metrics(run_dir):
    return [m for m in map(json.loads, (run_dir / "metrics.jsonl").open()) if m["step"] > 0]


def test_critic_trains_and_reports(tmp_path, micro_model_dir, digit_reward):
    train(config(micro_model_dir, digit_reward), tmp_path / "run", log=NO_LOG)
    steps = metrics(tmp_path / "run")
    keys = (
        "critic/vf_loss",
        "critic/vf_clipfrac",
        "critic/vf_explained_var",
        "critic/values/mean",
        "critic/returns/mean",
        "actor/pg_loss",
    )
    for m in steps:
        assert all(math.isfinite(m[k]) for k in keys), m
    assert steps[0]["critic/values/mean"] == 0.0  # the head starts at zero
    assert steps[-1]["critic/values/mean"] != 0.0  # and learns


def test_critic_warmup_holds_the_policy(tmp_path, micro_model_dir, digit_reward):
    cfg = config(micro_model_dir, digit_reward, **{"trainer.critic_warmup_steps": 2})
    train(cfg, tmp_path / "run", log=NO_LOG)
    steps = metrics(tmp_path / "run")
    assert ["actor/pg_loss" in m for m in steps] == [False, False, True, True]
    assert all("critic/vf_loss" in m for m in steps)


def test_resume_restores_the_critic_exactly(tmp_path, micro_model_dir, digit_reward):
    train(config(micro_model_dir, digit_reward), tmp_path / "a", log=NO_LOG)
    interrupted = config(micro_model_dir, digit_reward, **{"trainer.total_steps": 2})
    train(interrupted, tmp_path / "b", log=NO_LOG)
    train(config(micro_model_dir, digit_reward), tmp_path / "b", log=NO_LOG)
    state = {
        run: torch.load(tmp_path / run / "checkpoints" / "step_4" / "trainer_state.pt")
        for run in ("a", "b")
    }
    critic = {run: state[run]["trainers"]["critic"]["module"] for run in state}
    for name, tensor in critic["a"].items():
        assert torch.equal(tensor, critic["b"][name]), name
    assert [m["critic/vf_loss"] for m in metrics(tmp_path / "a")] == [
        m["critic/vf_loss"] for m in metrics(tmp_path / "b")
    ]


def test_critic_from_a_separate_model_path(tmp_path, micro_model_dir, digit_reward):
    from honing.errors import ConfigError
    from honing.pipeline.components import build_components

    cfg = config(micro_model_dir, digit_reward, **{"model.critic_path": str(micro_model_dir)})
    assert build_components(cfg, log=NO_LOG).trainers.critic is not None
    missing = config(micro_model_dir, digit_reward, **{"model.critic_path": str(tmp_path)})
    try:
        build_components(missing, log=NO_LOG)
    except ConfigError as err:
        assert "not a Hugging Face model directory" in str(err)
    else:
        raise AssertionError("a critic_path without config.json must be a config error")
