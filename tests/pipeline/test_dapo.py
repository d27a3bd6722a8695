"""DAPO's pieces in the loop: dynamic sampling, overlong shaping, masking truncated answers."""

import json

import pytest

from honing.backends.launch import train
from honing.config import build_config
from honing.errors import ConfigError
from honing.pipeline.rules import check_config

from ._configs import small_run_config

NO_LOG = lambda message: None  # noqa: E731

REWARDS = """
def half_uniform(response, ground_truth, *, prompt, **context):
    # Prompts with a "1" get the same reward for every sample: a uniform group.
    return 0.0 if "1" in prompt else float(len(response) % 2)


def always_one(response, ground_truth, **context):
    return 1.0
"""


@pytest.fixture
def rewards(tmp_path):
    path = tmp_path / "rewards.py"
    path.write_text(REWARDS)
    return path


def run(tmp_path, model_dir, reward, **overrides):
    specific = {
        "trainer.total_steps": 3,
        "rollout.batch_size": 4,
        "data.train_size": 60,
        "trainer.val_at_start": False,
        "checkpoint.every": 0,
    }
    train(small_run_config(model_dir, reward, **specific | overrides), tmp_path / "run", log=NO_LOG)
    lines = (tmp_path / "run" / "metrics.jsonl").open()
    return [m for m in map(json.loads, lines) if "samples/generated" in m]


def accounted(m):
    return (
        m["samples/generated"] == m["samples/trained"] + m["samples/filtered"] + m["samples/failed"]
    )


def test_dynamic_sampling_drops_uniform_groups_and_generates_more(
    tmp_path, micro_model_dir, rewards
):
    steps = run(
        tmp_path,
        micro_model_dir,
        f"{rewards}:half_uniform",
        **{"algorithm.dynamic_sampling": True, "algorithm.max_gen_rounds": 3},
    )
    assert all(accounted(m) for m in steps)
    assert sum(m.get("samples/filtered_uniform_group", 0) for m in steps) > 0
    assert max(m["samples/gen_rounds"] for m in steps) > 1
    # Trained groups never exceed the batch: at most batch_size x group_size samples.
    assert all(m["samples/trained"] <= 4 * 3 for m in steps)


def test_without_dynamic_sampling_uniform_groups_are_trained(tmp_path, micro_model_dir, rewards):
    steps = run(tmp_path, micro_model_dir, f"{rewards}:half_uniform")
    assert all(m["samples/trained"] == 12 and m["samples/gen_rounds"] == 1 for m in steps)


def test_overlong_penalty_lowers_rewards_near_the_limit(tmp_path, micro_model_dir, rewards):
    plain = run(tmp_path / "a", micro_model_dir, f"{rewards}:always_one")
    shaped = run(
        tmp_path / "b",
        micro_model_dir,
        f"{rewards}:always_one",
        **{"reward.overlong_buffer_len": 2},
    )
    assert all(m["critic/score/mean"] == 1.0 for m in plain)
    # Lengths 2 and 3 of a 3-token budget with a 2-token buffer cost 0.5 and 1.0.
    assert all(m["critic/score/mean"] < 1.0 for m in shaped)
    samples = [json.loads(line) for line in (tmp_path / "b" / "run" / "samples.jsonl").open()]
    penalised = [s for s in samples if "overlong_penalty" in s]
    assert penalised and all(s["reward"] == 1.0 + s["overlong_penalty"] for s in penalised)


def test_mask_truncated_filters_cut_off_answers(tmp_path, micro_model_dir, rewards):
    steps = run(
        tmp_path,
        micro_model_dir,
        f"{rewards}:always_one",
        **{"algorithm.mask_truncated": True, "rollout.max_new_tokens": 2},
    )
    assert all(accounted(m) for m in steps)
    truncated = sum(m["samples/filtered_truncated"] for m in steps)
    clipped = sum(round(m["response_length/clip_ratio"] * m["samples/generated"]) for m in steps)
    assert truncated == clipped > 0


def test_dual_clip_runs_and_is_validated(tmp_path, micro_model_dir, rewards):
    steps = run(
        tmp_path,
        micro_model_dir,
        f"{rewards}:half_uniform",
        **{"algorithm.clip_ratio_c": 3.0, "trainer.ppo_epochs": 2},
    )
    assert len(steps) == 3
    bad = build_config({"model.path": str(micro_model_dir), "algorithm.clip_ratio_c": 0.5})
    with pytest.raises(ConfigError, match="must be > 1"):
        check_config(bad)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_truncated_importance_sampling_reports_the_gap(tmp_path, micro_model_dir, rewards, level):
    steps = run(
        tmp_path,
        micro_model_dir,
        f"{rewards}:half_uniform",
        **{"algorithm.tis_level": level, "rollout.temperature": 0.7},
    )
    for m in steps:
        # In-process engine and trainer share weights: the gap is float noise only.
        assert 0.0 <= m["rollout_mismatch/kl"] < 1e-4
        assert m["rollout_mismatch/prob_diff_max"] < 1e-3
