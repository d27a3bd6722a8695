"""A short run through ``honing train``'s main function, and its determinism on CPU."""

import json

import pytest

from honing.cli import main


def train_args(model_dir, reward, out_dir, seed=0) -> list[str]:
    return [
        "train",
        f"model.path={model_dir}",
        f"reward.function={reward}",
        f"trainer.seed={seed}",
        "trainer.total_steps=2",
        "trainer.lr=1e-3",
        "rollout.batch_size=4",
        "rollout.group_size=4",
        "rollout.max_new_tokens=4",
        "rollout.val_samples=2",
        "data.train_size=100",
        "data.val_size=8",
        "monitor.console=false",
        "monitor.tensorboard=false",
        "--output-dir",
        str(out_dir),
    ]


def scores(run_dir) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [m["critic/score/mean"] for m in map(json.loads, lines) if m["step"] > 0]


@pytest.fixture(scope="module")
def first_run(micro_model_dir, digit_reward, tmp_path_factory):
    out = tmp_path_factory.mktemp("e2e") / "run"
    status = main(train_args(micro_model_dir, digit_reward, out))
    return status, out


def test_short_run_succeeds_and_summarises(first_run):
    status, out = first_run
    assert status == 0
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["first_step"], summary["last_step"]) == (0, 2)
    for key in ("val_accuracy_start", "val_accuracy_end"):
        assert 0.0 <= summary[key] <= 1.0
    assert summary["pass_at_k_key"] == "val/pass@2"
    assert (out / "checkpoints" / "step_2" / "COMPLETE").is_file()
    # Where each step's time went: every stage of the sync loop, and tokens per second.
    steps = [m for m in map(json.loads, (out / "metrics.jsonl").open()) if m["step"] > 0]
    stages = ("gen", "reward", "prepare", "update", "sync", "step")
    for m in steps:
        assert all(m[f"timing_s/{stage}"] >= 0 for stage in stages), m
        assert m["timing_s/step"] >= m["timing_s/gen"] + m["timing_s/update"]
        assert m["perf/throughput"] > 0
        generated = m["response_length/mean"] * m["samples/generated"]
        assert m["perf/gen_tokens_per_s"] == pytest.approx(generated / m["timing_s/gen"])
        assert m["perf/train_tokens_per_s"] > 0


def test_same_seed_same_metrics(first_run, micro_model_dir, digit_reward, tmp_path):
    _, out = first_run
    assert main(train_args(micro_model_dir, digit_reward, tmp_path / "again")) == 0
    assert scores(tmp_path / "again") == scores(out)
    assert len(scores(out)) == 2
    # A different seed samples differently: the equality above is not a constant.
    assert main(train_args(micro_model_dir, digit_reward, tmp_path / "other", seed=1)) == 0
    assert scores(tmp_path / "other") != scores(out)


def test_reference_model_and_several_updates_per_batch(micro_model_dir, digit_reward, tmp_path):
    """kl_coef > 0 loads a frozen reference; 2 epochs x 2 mini-batches freeze old logprobs."""
    args = train_args(micro_model_dir, digit_reward, tmp_path / "kl")
    args[-2:-2] = [
        "algorithm.kl_coef=0.05",
        "trainer.ppo_epochs=2",
        "trainer.mini_batch_size=2",
        "trainer.micro_batch_size=3",
        "trainer.warmup_steps=1",
        "trainer.lr_schedule=cosine",
    ]
    assert main(args) == 0
    steps = [json.loads(line) for line in (tmp_path / "kl" / "metrics.jsonl").open()]
    trained = [m for m in steps if m["step"] > 0]
    assert all("actor/kl_loss" in m and "timing_s/ref" in m for m in trained)
    # The policy moves away from the reference after the first update of step 1.
    assert trained[-1]["actor/kl_loss"] > 0.0
    # Later optimizer steps of a batch see a changed policy: the ratio leaves 1.
    assert any(m["actor/ppo_kl"] != 0.0 for m in trained)
