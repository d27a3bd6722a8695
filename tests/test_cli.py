"""The ``honing train`` entry point on bad input: one line on stderr, exit 2, nothing written.

Each case runs the command as ``honing.cli.main(argv)`` in the test's process, with the
environment, working directory and stderr a user's command would have; in a process of its
own only where how it starts is what is checked (under a wrapper, a fresh interpreter, the
supervisor's child). All of them fail before training starts, but the runs whose closing
lines (the validation's first and last figures) are read.
"""

import contextlib
import io
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from honing.cli import main
from honing.config import ENV_KEYS
from tests import warm


@dataclass
class Ran:
    """What a user sees of a command: its exit status and what it wrote to stderr."""

    returncode: int
    stderr: str
    stdout: str = ""


def run_cli(argv: list[str], cwd: Path, env: dict[str, str]) -> Ran:
    """``honing ARGV`` in this process, in ``cwd`` with exactly ``env``; both restored."""
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    stdout, stderr = io.StringIO(), io.StringIO()
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(stdout):
            try:
                status = main(argv)
            except SystemExit as exited:  # argparse's usage errors
                status = exited.code
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
    return Ran(status, stderr.getvalue(), stdout.getvalue())


def run_train(tmp_path, *args: str, env: dict | None = None, wrap=(), cold=False):
    """``honing train ARGS`` in this process (``env`` added to the environment without
    honing's keys); in a process of its own under ``wrap`` (a command it runs under) or when
    ``cold`` (a fresh interpreter: its CPU time is the test's children's)."""
    env = {k: v for k, v in os.environ.items() if k not in ENV_KEYS} | (env or {})
    env["HONING_CACHE"] = str(tmp_path / "cache")
    env["TOKENIZERS_PARALLELISM"] = "false"
    if not (wrap or cold):
        return run_cli(["train", *args], tmp_path, env)
    return subprocess.run(
        [*wrap, sys.executable, "-m", "honing.cli", "train", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def error_line(result: Ran | subprocess.CompletedProcess) -> str:
    """The single stderr line of a user error; fails unless there is exactly one."""
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert result.returncode == 2, result.stderr
    assert lines[0].startswith("honing: error: ")
    return lines[0]


@pytest.fixture
def model_arg(micro_model_dir) -> str:
    return f"model.path={micro_model_dir}"


def test_unknown_config_key(tmp_path, model_arg):
    result = run_train(tmp_path, model_arg, "rollout.grup_size=4", "--output-dir", "out")
    line = error_line(result)
    assert "'rollout.grup_size'" in line
    assert "did you mean rollout.group_size?" in line
    assert not (tmp_path / "out").exists()
    assert not (tmp_path / "cache").exists()  # nothing was built either


def test_bad_value_type(tmp_path, model_arg):
    result = run_train(tmp_path, model_arg, "rollout.group_size=four", "--output-dir", "out")
    assert error_line(result) == "honing: error: rollout.group_size: expected int, got 'four'"
    assert not (tmp_path / "out").exists()


def test_missing_config_file(tmp_path, model_arg):
    result = run_train(tmp_path, "missing.yaml", model_arg, "--output-dir", "out")
    assert error_line(result) == "honing: error: config file not found: missing.yaml"
    assert not (tmp_path / "out").exists()


def test_bad_yaml_config(tmp_path, model_arg):
    (tmp_path / "bad.yaml").write_text("trainer:\n  lr: 0.001\n   seed: 3\n")
    result = run_train(tmp_path, "bad.yaml", model_arg, "--output-dir", "out")
    assert error_line(result).startswith("honing: error: bad.yaml:3: not valid YAML")
    assert not (tmp_path / "out").exists()


def test_missing_dataset_file(tmp_path, model_arg):
    result = run_train(
        tmp_path,
        model_arg,
        "data.train_files=[missing.jsonl]",
        "data.val_files=[missing.jsonl]",
        "--output-dir",
        "out",
    )
    assert "data file not found: missing.jsonl" in error_line(result)
    assert not (tmp_path / "out").exists()


def test_malformed_dataset_row_names_file_and_line(tmp_path, model_arg):
    good = {"prompt": "1+1=", "reward_model": {"ground_truth": "2"}}
    (tmp_path / "train.jsonl").write_text(json.dumps(good) + "\n{not json\n")
    (tmp_path / "val.jsonl").write_text(json.dumps(good) + "\n")
    result = run_train(
        tmp_path,
        model_arg,
        "data.train_files=[train.jsonl]",
        "data.val_files=[val.jsonl]",
        "--output-dir",
        "out",
    )
    line = error_line(result)
    assert "train.jsonl:2: invalid JSON" in line
    assert not (tmp_path / "out").exists()


def test_numeric_dataset_file_name(tmp_path, model_arg):
    # `data.train_files=[2024]` is parsed by YAML as a list of one int; the file name must still
    # be handled as a name (found or not found), not crash with a traceback.
    result = run_train(
        tmp_path,
        model_arg,
        "data.train_files=[2024]",
        "data.val_files=[2024]",
        "--output-dir",
        "out",
    )
    assert "2024" in error_line(result)
    assert not (tmp_path / "out").exists()


def test_resume_never_into_an_existing_run(tmp_path, model_arg):
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    result = run_train(tmp_path, model_arg, "--output-dir", "out", "--resume", "never")
    line = error_line(result)
    assert "out already holds a run" in line
    assert "--resume auto" in line
    assert [p.name for p in out.iterdir()] == ["metrics.jsonl"]
    assert (out / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_resume_from_a_path_that_is_not_a_checkpoint(tmp_path, model_arg):
    result = run_train(tmp_path, model_arg, "--output-dir", "out", "--resume", "nowhere")
    line = error_line(result)
    assert "--resume nowhere: not a complete checkpoint (does not exist)" in line
    assert not (tmp_path / "out").exists()


def test_overrides_may_follow_the_options(tmp_path):
    """`train --output-dir D key=value` reads the override (here: an unknown key, exit 2)."""
    result = run_train(tmp_path, "--output-dir", str(tmp_path / "o"), "rollout.grup_size=3")
    assert "did you mean rollout.group_size" in error_line(result)


def run_serve(tmp_path, *args: str) -> subprocess.CompletedProcess:
    """``honing serve ARGS`` on a free port (the port is taken before the app is built), in a
    process of its own: a server that wrongly started would not hold the test up."""
    return subprocess.run(
        warm.honing("serve", *args, "--port", "0"),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_serve_reward_model_without_a_model_is_one_line(tmp_path):
    line = error_line(run_serve(tmp_path, "reward-model", "--model", str(tmp_path / "nope")))
    assert "cannot load a sequence-classification model from" in line


def test_serve_verifier_bad_route_is_one_line(tmp_path):
    line = error_line(run_serve(tmp_path, "verifier", "--route", "openai/gsm8k"))
    assert "--route expects DATA_SOURCE=SPEC" in line


def test_serve_verifier_unknown_function_is_one_line(tmp_path):
    line = error_line(run_serve(tmp_path, "verifier", "--function", "nope_fn"))
    assert "unknown reward function 'nope_fn'" in line


@pytest.mark.slow
def test_max_restarts_runs_training_as_a_supervised_child(tmp_path, micro_model_dir, digit_reward):
    out = tmp_path / "run"
    result = run_train(
        tmp_path,
        f"model.path={micro_model_dir}",
        f"reward.function={digit_reward}",
        "trainer.total_steps=2",
        "rollout.batch_size=2",
        "rollout.group_size=2",
        "rollout.max_new_tokens=2",
        "trainer.val_every=0",
        "data.val_size=2",
        "monitor.console=false",
        "--max-restarts",
        "2",
        "--output-dir",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    assert (out / "checkpoints" / "step_2" / "COMPLETE").is_file()
    assert "restart" not in [json.loads(line)["kind"] for line in (out / "events.jsonl").open()]


def test_checkpoints_of_a_missing_run_is_one_line(tmp_path):
    result = run_cli(["checkpoints", str(tmp_path / "nope")], tmp_path, dict(os.environ))
    assert "no such run directory" in error_line(result)


@pytest.mark.parametrize("val_at_start", [True, False])
def test_the_closing_lines_claim_a_change_only_between_two_validations(
    tmp_path, micro_model_dir, digit_reward, val_at_start
):
    """Validated at steps 0 and 2: first -> last with the change in points. Validated at step
    2 only: the one figure, no change claimed."""
    result = run_train(
        tmp_path,
        f"model.path={micro_model_dir}",
        f"reward.function={digit_reward}",
        "trainer.total_steps=2",
        f"trainer.val_at_start={str(val_at_start).lower()}",
        "rollout.batch_size=2",
        "rollout.group_size=2",
        "rollout.max_new_tokens=2",
        "rollout.val_samples=2",
        "trainer.val_every=0",
        "data.val_size=2",
        "monitor.console=false",
        "monitor.tensorboard=false",
        "--output-dir",
        str(tmp_path / "run"),
    )

    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"run: {tmp_path / 'run'}"
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    first, last = summary["val_accuracy_start"], summary["val_accuracy_end"]
    first_pass, last_pass = summary["pass_at_k_start"], summary["pass_at_k_end"]
    assert summary["pass_at_k_key"] == "val/pass@2"
    seconds = f"{summary['seconds']:.0f} s"
    if val_at_start:
        points = f"{100 * (last - first):+.1f} points"
        assert lines[1:] == [
            f"val/accuracy: {first:.3f} at step 0 -> {last:.3f} at step 2 ({points}, {seconds})",
            f"val/pass@2: {first_pass:.3f} -> {last_pass:.3f}",
        ]
    else:
        assert lines[1:] == [
            f"val/accuracy: {last:.3f} at step 2 ({seconds})",
            f"val/pass@2: {last_pass:.3f}",
        ]
