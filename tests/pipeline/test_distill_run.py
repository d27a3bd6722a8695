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
        (DISTILL, "algorithm.advantage=distill needs one teacher: algorithm.teacher_path"),
        (
            DISTILL | {"algorithm.teacher_path": "/t", "algorithm.teacher_endpoint": "http://h:1"},
            "needs one teacher: .* 2 given",
        ),
        ({"algorithm.teacher_endpoint": "http://h:1"}, "teacher_endpoint is set but"),
        ({"algorithm.teacher_path": "/t"}, "teacher_path is set but algorithm.advantage=grpo"),
        ({"algorithm.distill_score_coef": 1.0}, "distill_score_coef=1.0 has no effect with"),
    ],
)
def test_distillation_without_its_teacher_or_a_teacher_without_it_is_one_line(values, message):
    with pytest.raises(ConfigError, match=message) as refused:
        check_config(build_config(BASE | values))
    assert "\n" not in str(refused.value)


@pytest.mark.slow
def test_a_served_teacher_grades_as_the_same_teacher_loaded_locally(tmp_path, micro_model_dir):
    """The teacher behind ``honing serve rollout`` (vLLM's prompt_logprobs): the first step's
    reverse KL and advantages are the local teacher's, to float rounding (the same samples:
    the step's batch is drawn before any update)."""
    from tests.warm import start_service

    teacher = _teacher(micro_model_dir, tmp_path / "teacher")
    process, url = start_service("rollout", "--model", str(teacher))
    try:
        runs = {}
        for name, where in (
            ("local", {"algorithm.teacher_path": str(teacher)}),
            ("served", {"algorithm.teacher_endpoint": url}),
        ):
            values = DISTILL | where | {"trainer.total_steps": 1, "trainer.val_at_start": False}
            config = small_run_config(micro_model_dir, "numeric", **values)
            train(config, tmp_path / name, resume="never", log=lambda message: None)
            lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
            [runs[name]] = [m for m in map(json.loads, lines) if m["step"] == 1]
    finally:
        process.kill()
        process.wait()
    local, served = runs["local"], runs["served"]
    assert served["critic/score/mean"] == local["critic/score/mean"]  # the same samples
    assert served["timing_s/teacher"] > 0 and local["distill/reverse_kl"] > 0.3
    for key in ("distill/reverse_kl", "critic/advantages/mean", "critic/advantages/var"):
        assert served[key] == pytest.approx(local[key], rel=1e-5, abs=1e-6), key


def test_a_server_gives_each_prompt_token_s_own_logprob_and_refuses_top_alternatives(
    micro_model_dir,
):
    """``prompt_logprobs: 0`` on honing's server: the model's logprob of each prompt token
    after those before it, as a forward pass computes them; another value is a 400."""
    from honing.rollout.native.engine import TransformersEngine
    from honing.services.app import Refused
    from honing.services.options import CompletionLimits
    from honing.services.rollout import _Served

    tokenizer = load_tokenizer(micro_model_dir)
    model = load_causal_lm(micro_model_dir, tokenizer, dtype="float32", device=torch.device("cpu"))
    engine = TransformersEngine(model, tokenizer, device=torch.device("cpu"))
    serving = _Served(engine, "m", CompletionLimits())
    ids = tokenizer("12+34=", add_special_tokens=False)["input_ids"]
    body = {"prompt": [ids, ids[:3]], "max_tokens": 1, "prompt_logprobs": 0}
    first, second = serving.complete(body)["choices"]
    with torch.no_grad():
        want = model(input_ids=torch.tensor([ids])).logits[0, :-1].log_softmax(-1)
    scored = zip(first["prompt_logprobs"][1:], ids[1:], strict=True)
    got = torch.tensor([entry[str(token)]["logprob"] for entry, token in scored])
    assert first["prompt_logprobs"][0] is None and len(second["prompt_logprobs"]) == 3
    torch.testing.assert_close(got, want.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0])
    with pytest.raises(Refused, match="prompt_logprobs: 5"):
        serving.complete(body | {"prompt_logprobs": 5})
