"""One optimizer step per batch: the update's own forward, before the step, gives the old
logprobs, so no separate pass runs for them; the TIS weights and the engine/trainer gap's
metrics come from that forward, equal to what the separate pass gave. On the bigram policy
(``fakes``), through the real loop."""

import json

import pytest
import torch
from safetensors.torch import load_file

from honing.pipeline import evaluate, experience
from honing.pipeline.run import train_here

from . import fakes
from .test_loop_logic import NO_LOG, config

GAP = (
    "rollout_mismatch/kl",
    "rollout_mismatch/prob_diff_mean",
    "rollout_mismatch/prob_diff_max",
    "rollout_mismatch/logprob_diff_max",
)
STEPS = 4


@pytest.fixture(autouse=True)
def no_rescoring_waits(monkeypatch):
    monkeypatch.setattr(evaluate, "RESCORE_WAITS_S", (0.0, 0.0))


def _run(tmp_path, name, cfg, monkeypatch):
    """The run's step metrics, last weights and the policy's forward calls."""
    calls = []
    forward = fakes.TinyLM.forward

    def counted(self, *args, **kwargs):
        calls.append(1)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(fakes.TinyLM, "forward", counted)
    train_here(cfg, tmp_path / name, log=NO_LOG, build=fakes.fake_components)
    monkeypatch.setattr(fakes.TinyLM, "forward", forward)
    lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
    steps = [m for m in map(json.loads, lines) if m["step"] >= 1]
    weights = load_file(tmp_path / name / "checkpoints" / f"step_{STEPS}" / "model.safetensors")
    return steps, weights, len(calls)


@pytest.mark.parametrize(
    "weighing",
    [
        {"algorithm.tis_level": "token", "algorithm.tis_cap": 1.2},
        {"algorithm.tis_level": "sequence", "algorithm.tis_cap": 1.2},
        {"algorithm.rollout_is": "sequence", "algorithm.rollout_is_threshold": "0.8_1.2"},
    ],
    ids=["tis-token", "tis-sequence", "rollout-is-icepop"],
)
def test_one_step_weighs_the_rollouts_in_the_updates_forward(
    tmp_path, digit_reward, monkeypatch, weighing
):
    """one_step samples step k with version k - 2, so the rollouts' logprobs are the
    engine's and TIS (or rollout correction's weights) weighs them. Against today's separate
    old pass (forced): one forward fewer per step, the same samples, the same gap metrics and
    the same weights (float rounding: the pass and the update's forward are the same
    arithmetic on the same rows)."""
    values = {"schedule.mode": "one_step", "trainer.total_steps": STEPS, "trainer.val_every": 0}
    values |= {"checkpoint.every": STEPS, **weighing}
    cfg = config(digit_reward, **values)
    folded, folded_weights, folded_calls = _run(tmp_path, "folded", cfg, monkeypatch)
    with monkeypatch.context() as patch:
        patch.setattr(experience, "needs_old_logprobs", lambda *args, **kwargs: True)
        separate, separate_weights, separate_calls = _run(tmp_path, "separate", cfg, monkeypatch)
    assert separate_calls - folded_calls == STEPS  # the old pass: one forward of the batch
    assert all("timing_s/old" in m for m in separate)
    assert not any("timing_s/old" in m for m in folded)
    scores = [m["critic/score/mean"] for m in folded]
    assert scores == [m["critic/score/mean"] for m in separate]  # the same samples
    assert any(m["rollout_mismatch/logprob_diff_max"] > 0.05 for m in folded)  # stale samples
    corrections = [key for key in folded[-1] if key.startswith("rollout_corr/")]
    assert bool(corrections) == ("algorithm.rollout_is" in weighing)
    if corrections:  # IcePop zeroes the weights of some stale samples
        assert any(m["rollout_corr/rollout_is_min"] == 0 for m in folded)
    for a, b in zip(folded, separate, strict=True):
        for key in (*GAP, *corrections, "actor/pg_loss", "actor/pg_clipfrac"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key
    assert folded_weights.keys() == separate_weights.keys()
    for name, want in separate_weights.items():
        torch.testing.assert_close(folded_weights[name], want, atol=1e-6, rtol=1e-6)
