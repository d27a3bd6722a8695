"""On-policy distillation in a run: the student samples, a teacher of the same tokenizer
grades each token, and the reverse KL to the teacher falls; a teacher of another tokenizer,
and a teacher with no distillation (or the reverse), are one line before anything trains."""

import json

import pytest
import torch

from honing.backends.launch import train
from honing.config import build_config
from honing.errors import ConfigError
from honing.models.loading import load_causal_lm, load_tokenizer, save_model
from honing.models.tiny import build_tokenizer
from honing.pipeline.rules import check_config

from ._configs import BASE, small_run_config

DISTILL = {"algorithm.advantage": "distill"}


def _teacher(micro_model_dir, directory, tokenizer=None):
    """The micro model with its weights moved (another model of the same tokenizer)."""
    ours = load_tokenizer(micro_model_dir)
    model = load_causal_lm(micro_model_dir, ours, dtype="float32", device=torch.device("cpu"))
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.2)
    save_model(model, tokenizer or ours, directory)
    return directory


def test_each_token_s_advantage_is_the_teacher_s_logprob_minus_the_student_s(
    tmp_path, micro_model_dir
):
    """Pure distillation scaled by distill_coef=2: the teacher pass runs each step, and the
    advantages' mean over the response tokens is -2 x the reverse KL estimate (their mean is
    2 x mean(log pi_teacher - log pi_student)); the student's updates follow it. (That the
    student learns from a better teacher: benchmarks/distill_demo.py.)"""
    teacher = _teacher(micro_model_dir, tmp_path / "teacher")
    values = DISTILL | {
        "algorithm.teacher_path": str(teacher),
        "algorithm.distill_coef": 2.0,
        "trainer.total_steps": 3,
        "trainer.val_at_start": False,
    }
    config = small_run_config(micro_model_dir, "numeric", **values)
    train(config, tmp_path / "run", resume="never", log=lambda message: None)
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    steps = [m for m in map(json.loads, lines) if m["step"] >= 1]
    assert len(steps) == 3
    for m in steps:
        assert m["timing_s/teacher"] > 0 and m["distill/reverse_kl"] > 0.3  # another model
        assert m["critic/advantages/mean"] == pytest.approx(-2 * m["distill/reverse_kl"], 1e-5)
        assert m["actor/grad_norm"] > 0


def test_a_teacher_of_another_tokenizer_is_one_line(tmp_path, micro_model_dir):
    other = build_tokenizer()
    other.add_tokens(["<|another|>"])
    teacher = _teacher(micro_model_dir, tmp_path / "teacher", tokenizer=other)
    config = small_run_config(
        micro_model_dir, "numeric", **DISTILL, **{"algorithm.teacher_path": str(teacher)}
    )
    with pytest.raises(ConfigError) as refused:
        train(config, tmp_path / "run", resume="never", log=lambda message: None)
    message = str(refused.value)
    assert "\n" not in message and "its tokenizer is not the policy's" in message


@pytest.mark.parametrize(
    "values, message",
    [
        (DISTILL, "algorithm.advantage=distill needs algorithm.teacher_path"),
        ({"algorithm.teacher_path": "/t"}, "teacher_path is set but algorithm.advantage=grpo"),
        ({"algorithm.distill_score_coef": 1.0}, "distill_score_coef=1.0 has no effect with"),
    ],
)
def test_distillation_without_its_teacher_or_a_teacher_without_it_is_one_line(values, message):
    with pytest.raises(ConfigError, match=message) as refused:
        check_config(build_config(BASE | values))
    assert "\n" not in str(refused.value)
