"""Every advantage estimator and policy loss the loop can drive runs end to end, finitely."""

import json
import math

import pytest

from honing.backends.launch import train

from ._configs import small_run_config

NO_LOG = lambda message: None  # noqa: E731


def config(model_dir, reward, **overrides):
    specific = {
        "trainer.total_steps": 2,
        "trainer.val_at_start": False,
        "trainer.lr": 1e-3,
    }
    return small_run_config(model_dir, reward, **specific | overrides)


@pytest.mark.parametrize(
    "advantage",
    [
        "grpo",
        "dr_grpo",
        "rloo",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
        "remax",
        "gae",
    ],
)
@pytest.mark.parametrize("loss", ["ppo_clip", "gspo", "cispo"])
def test_runs_and_stays_finite(tmp_path, micro_model_dir, digit_reward, advantage, loss):
    cfg = config(
        micro_model_dir,
        digit_reward,
        **{"algorithm.advantage": advantage, "algorithm.policy_loss": loss},
    )
    train(cfg, tmp_path / "run", log=NO_LOG)
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    trained = [m for m in steps if "actor/pg_loss" in m]
    assert len(trained) == 2
    for m in trained:
        for key in ("actor/pg_loss", "actor/grad_norm", "critic/advantages/mean"):
            assert m[key] is not None and math.isfinite(m[key]), (key, m)
        assert m["critic/advantages/var"] >= 0 and m["critic/score/std"] >= 0


def test_remax_baseline_is_the_greedy_answers_score(tmp_path, micro_model_dir, digit_reward):
    """ReMax: A = r - r(greedy answer). One greedy answer per prompt sets the baseline; those
    rollouts are neither trained on nor counted as samples."""
    from honing.pipeline.collect import collect
    from honing.pipeline.components import build_components

    cfg = config(micro_model_dir, digit_reward, **{"algorithm.advantage": "remax"})
    parts = build_components(cfg, log=NO_LOG)
    got = collect(cfg, parts, step=1, seed=5)
    assert sorted(got.baselines) == [0, 1]  # one greedy score per prompt (group)
    assert len(got.rollouts) == 2 * 3  # the greedy rollouts are not counted as samples
