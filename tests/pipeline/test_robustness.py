"""Bad input and awkward resumes: one clear error and nothing lost, or the right thing done."""

import json
import shutil
import socket

import pytest
import torch

from honing.backends.launch import train
from honing.checkpoint import CheckpointManager
from honing.checkpoint.manifest import write_manifest
from honing.cli import main
from honing.errors import ConfigError, DataError, UserError
from honing.pipeline.components import build_components
from honing.pipeline.rules import check_config
from honing.trainer.engine import TrainedModule
from honing.trainer.policy_update import UpdateSettings, update_policy

from ._configs import cli_args, small_run_config

NO_LOG = lambda message: None  # noqa: E731


def small(model_dir, reward, **overrides):
    specific = {
        "trainer.total_steps": 4,
        "rollout.group_size": 2,
        "checkpoint.every": 1,
        "checkpoint.keep": 10,
    }
    return small_run_config(model_dir, reward, **specific | overrides)


def write_rows(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_same_file_name_for_train_and_val_keeps_them_apart(tmp_path, micro_model_dir):
    row = lambda q, a: {"prompt": q, "reward_model": {"ground_truth": a}}  # noqa: E731
    write_rows(tmp_path / "a" / "train.jsonl", [row("1+2=", "3"), row("2+2=", "4")])
    write_rows(tmp_path / "b" / "train.jsonl", [row("9+9=", "18")])
    config = small(
        micro_model_dir,
        "numeric",
        **{
            "data.train_files": [str(tmp_path / "a" / "train.jsonl")],
            "data.val_files": [str(tmp_path / "b" / "train.jsonl")],
        },
    )
    parts = build_components(config, log=NO_LOG)
    [val] = parts.val_prompts
    assert parts.rendered[val.id] == "9+9=" and val.ground_truth == "18"


def test_two_train_files_with_one_basename_load(tmp_path, micro_model_dir):
    row = {"prompt": "1+1=", "reward_model": {"ground_truth": "2"}}
    for folder in ("gsm8k", "math", "val"):
        write_rows(tmp_path / folder / "train.jsonl", [row])
    config = small(
        micro_model_dir,
        "numeric",
        **{
            "data.train_files": [str(tmp_path / f / "train.jsonl") for f in ("gsm8k", "math")],
            "data.val_files": [str(tmp_path / "val" / "train.jsonl")],
        },
    )
    assert len(build_components(config, log=NO_LOG).train_prompts) == 2


def test_train_files_without_val_files_is_a_config_error(tmp_path, micro_model_dir):
    write_rows(tmp_path / "t.jsonl", [{"prompt": "1+1=", "reward_model": {"ground_truth": "2"}}])
    config = small(micro_model_dir, "numeric", **{"data.train_files": [str(tmp_path / "t.jsonl")]})
    with pytest.raises(ConfigError, match="data.val_files is empty"):
        check_config(config)


def test_non_numeric_ground_truth_is_found_at_load(tmp_path, micro_model_dir):
    rows = [
        {"prompt": "x", "reward_model": {"ground_truth": "7"}},
        {"prompt": "y", "reward_model": {"ground_truth": "seven"}},
    ]
    write_rows(tmp_path / "t.jsonl", rows)
    config = small(
        micro_model_dir,
        "numeric",
        **{
            "data.train_files": [str(tmp_path / "t.jsonl")],
            "data.val_files": [str(tmp_path / "t.jsonl")],
        },
    )
    with pytest.raises(DataError, match=r"t.jsonl:2: ground truth 'seven' is not a number"):
        build_components(config, log=NO_LOG)


def test_grpo_needs_groups(micro_model_dir):
    with pytest.raises(ConfigError, match="group_size"):
        check_config(small(micro_model_dir, "numeric", **{"rollout.group_size": 1}))


def test_model_dir_without_tokenizer_is_one_line(tmp_path, micro_model_dir, capsys):
    broken = tmp_path / "no_tokenizer"
    broken.mkdir()
    for name in ("config.json", "model.safetensors"):
        (broken / name).write_bytes((micro_model_dir / name).read_bytes())
    assert main(["train", f"model.path={broken}", "--output-dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot load a tokenizer" in err[0]
    assert not (tmp_path / "o").exists()


def test_resume_from_another_models_checkpoint(tmp_path, micro_model_dir, digit_reward, capsys):
    train(
        small(micro_model_dir, digit_reward, **{"trainer.total_steps": 1}),
        tmp_path / "a",
        log=NO_LOG,
    )
    # A checkpoint whose tensors have other shapes: shrink the embedding in a copy.
    from safetensors.torch import load_file, save_file

    ckpt = tmp_path / "a" / "checkpoints" / "step_1"
    weights = load_file(ckpt / "model.safetensors")
    weights = {k: v[..., :8].contiguous() if v.dim() == 2 else v for k, v in weights.items()}
    save_file(weights, ckpt / "model.safetensors", metadata={"format": "pt"})
    write_manifest(ckpt)  # a genuine checkpoint of another model, not a damaged one
    status = main(
        [
            "train",
            f"model.path={micro_model_dir}",
            f"reward.function={digit_reward}",
            "--output-dir",
            str(tmp_path / "b"),
            "--resume",
            str(ckpt),
        ]
    )
    assert status == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not fit" in err[0]
    assert not (tmp_path / "b").exists()


def test_resume_from_an_earlier_checkpoint_sets_newer_ones_aside(
    tmp_path, micro_model_dir, digit_reward
):
    run = tmp_path / "run"
    train(small(micro_model_dir, digit_reward), run, log=NO_LOG)
    checkpoints = CheckpointManager(run / "checkpoints", keep=10)
    assert checkpoints.complete_steps() == [1, 2, 3, 4]
    config = small(micro_model_dir, digit_reward, **{"trainer.total_steps": 3})
    train(config, run, resume=str(run / "checkpoints" / "step_2"), log=NO_LOG)
    assert checkpoints.complete_steps() == [1, 2, 3]
    shelved = list((run / "checkpoints").glob("abandoned-*/step_*"))
    assert sorted(p.name for p in shelved) == [
        "step_3",
        "step_4",
    ]  # kept, out of --resume auto's way
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").open()]
    assert steps == [0, 1, 2, 3]


def test_restart_without_checkpoint_does_not_repeat_step_zero(
    tmp_path, micro_model_dir, digit_reward
):
    run = tmp_path / "run"
    config = small(
        micro_model_dir, digit_reward, **{"checkpoint.every": 0, "trainer.total_steps": 2}
    )
    train(config, run, log=NO_LOG)
    for path in (run / "checkpoints").iterdir():  # as if it crashed before any checkpoint
        shutil.rmtree(path)
    summary = train(config, run, log=NO_LOG)
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").open()]
    assert steps == [0, 1, 2]
    assert summary["first_step"] == 0 and summary["last_step"] == 2


def test_resume_without_optimizer_state_uses_the_scheduled_lr(
    tmp_path, micro_model_dir, digit_reward
):
    run = tmp_path / "run"
    overrides = {
        "checkpoint.save_optimizer": False,
        "trainer.warmup_steps": 10,
        "trainer.lr": 1e-3,
        "trainer.total_steps": 3,
    }
    train(small(micro_model_dir, digit_reward, **overrides), run, log=NO_LOG)
    config = small(micro_model_dir, digit_reward, **overrides | {"trainer.total_steps": 4})
    train(config, run, log=NO_LOG)
    lrs = {
        m["step"]: m["actor/lr"]
        for m in map(json.loads, (run / "metrics.jsonl").open())
        if "actor/lr" in m
    }
    assert lrs[4] == pytest.approx(1e-3 * 4 / 10)  # warmup factor of step index 3 is 4/10


def test_non_finite_gradient_skips_the_update(micro_model_dir):
    from honing.models.loading import load_causal_lm, load_tokenizer
    from honing.trainer.batch import collate
    from honing.types import Rollout

    tokenizer = load_tokenizer(micro_model_dir)
    model = load_causal_lm(micro_model_dir, tokenizer, dtype="float32", device=torch.device("cpu"))
    rollouts = [Rollout("p", 0, [5, 6], [7, 8], [-1.0, -1.0], "length", 0, "")] * 2
    batch = collate(rollouts, tokenizer.pad_token_id, torch.device("cpu"))
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    advantages = torch.full((2, 2), float("nan"))
    engine = TrainedModule("policy", model, optimizer)
    metrics = update_policy(engine, batch, advantages, UpdateSettings())
    assert metrics["actor/skipped_updates"] == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_bad_yaml_in_an_override_is_a_config_error():
    from honing.config import resolve_config

    with pytest.raises(ConfigError, match=r"data.train_files: '\[a.jsonl' is not a valid value"):
        resolve_config(None, ["data.train_files=[a.jsonl"], environ={})
    assert issubclass(ConfigError, UserError)


@pytest.mark.parametrize("existing", [False, True])
def test_a_prometheus_port_in_use_is_refused_before_anything_is_written(
    tmp_path, micro_model_dir, digit_reward, capsys, existing
):
    """Also into a run directory that holds a run: it is left as it was."""
    run_dir = tmp_path / "run"
    settings = {"trainer.total_steps": 1, "monitor.tensorboard": True}
    if existing:
        train(small_run_config(micro_model_dir, digit_reward, **settings), run_dir, log=NO_LOG)
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")} if existing else {}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        settings["monitor.prometheus_port"] = port
        status = main(["train", *cli_args(micro_model_dir, digit_reward, run_dir, **settings)])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1, err
    assert err[0].startswith(f"honing: error: monitor.prometheus_port={port}: cannot listen on")
    assert err[0].endswith("choose another port, or 0 for none")
    if existing:
        assert {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")} == before
    else:
        assert not run_dir.exists()  # no config.yaml, no tensorboard/
