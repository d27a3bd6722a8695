"""Careless input to ``honing train``: each case is one line on stderr, exit 2, and nothing
written, as a user sees it (``tests.test_cli.run_train``: the command in this process, or in
one of its own where the process is what is checked: a read-only mount, its CPU time)."""

import json
import resource
import shutil
import subprocess

import pytest

from tests.test_cli import error_line, run_train

TRAIN = ["rollout.batch_size=2", "rollout.group_size=2", "data.val_size=2", "trainer.total_steps=1"]


@pytest.fixture
def model_copy(tmp_path, micro_model_dir):
    """A copy of the micro model that a test may damage."""
    return shutil.copytree(micro_model_dir, tmp_path / "model")


@pytest.mark.parametrize("override", ["trainer.lr=inf", "rollout.temperature=.inf"])
def test_a_non_finite_setting(tmp_path, micro_model_dir, override):
    result = run_train(tmp_path, f"model.path={micro_model_dir}", override, "--output-dir", "out")
    assert "expected a finite number" in error_line(result)
    assert not (tmp_path / "out").exists()


def test_a_key_given_twice_in_the_config_file(tmp_path, micro_model_dir):
    (tmp_path / "run.yaml").write_text("trainer:\n  lr: 1.0e-5\n  lr: 10.0\n")
    result = run_train(tmp_path, "run.yaml", f"model.path={micro_model_dir}", "--output-dir", "o")
    assert "run.yaml:3: not valid YAML (duplicate key 'lr' (also at line 2)" in error_line(result)


@pytest.mark.parametrize("endpoint", ["not-a-url", "ftp://x"])
def test_a_bad_verifier_endpoint_is_refused_with_the_config(tmp_path, micro_model_dir, endpoint):
    result = run_train(
        tmp_path,
        f"model.path={micro_model_dir}",
        "--output-dir",
        "out",
        env={"VERIFIER_ENDPOINT": endpoint},
    )
    assert f"reward.endpoint: '{endpoint}' is not an http(s) URL" in error_line(result)
    assert not (tmp_path / "out").exists()  # no config.yaml, empty logs or tensorboard/


def test_truncated_model_weights(tmp_path, model_copy):
    weights = model_copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    result = run_train(tmp_path, f"model.path={model_copy}", "--output-dir", "out")
    line = error_line(result)
    assert f"model.path: cannot load a causal LM from {model_copy}" in line
    assert not (tmp_path / "out").exists()


def test_a_corrupt_model_config_is_named_as_such(tmp_path, model_copy):
    (model_copy / "config.json").write_text('{"model_type": "llama", ')
    line = error_line(run_train(tmp_path, f"model.path={model_copy}", "--output-dir", "out"))
    assert f"model.path: {model_copy / 'config.json'} is not valid JSON" in line
    assert "tokenizer" not in line


def test_an_output_dir_under_a_file(tmp_path, micro_model_dir):
    (tmp_path / "file").write_text("")
    result = run_train(tmp_path, f"model.path={micro_model_dir}", "--output-dir", "file/run")
    assert "--output-dir file/run: " in error_line(result) and "is a file" in error_line(result)


def _unshare_works() -> bool:
    try:
        probe = ["unshare", "-rm", "true"]
        return subprocess.run(probe, capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@pytest.mark.skipif(not _unshare_works(), reason="needs unshare -rm (user + mount namespaces)")
@pytest.mark.slow
def test_resuming_into_a_read_only_run_directory(tmp_path, micro_model_dir, digit_reward):
    common = [f"model.path={micro_model_dir}", f"reward.function={digit_reward}", *TRAIN]
    run = tmp_path / "run"
    assert run_train(tmp_path, *common, "--output-dir", str(run)).returncode == 0
    before = sorted(p.name for p in run.rglob("*"))
    # The run directory bound read-only in a mount namespace of its own, as a read-only
    # volume would be; the process is root there, so permissions alone would not stop it.
    script = f'mount --bind "{run}" "{run}" && mount -o remount,bind,ro "{run}" && exec "$@"'
    result = run_train(
        tmp_path,
        *common,
        "trainer.total_steps=2",
        "--output-dir",
        str(run),
        wrap=["unshare", "-rm", "sh", "-c", script, "sh"],
    )
    assert f"--output-dir {run}: {run} is not writable" in error_line(result)
    assert sorted(p.name for p in run.rglob("*")) == before


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


@pytest.mark.slow
def test_a_huge_prompt_is_named_by_file_and_line_without_tokenizing_it(tmp_path, micro_model_dir):
    row = lambda text: json.dumps({"prompt": text, "reward_model": {"ground_truth": "2"}})  # noqa: E731
    (tmp_path / "train.jsonl").write_text(row("1+1=") + "\n" + row("9" * 5_000_000) + "\n")
    (tmp_path / "val.jsonl").write_text(row("1+1=") + "\n")
    started = _children_cpu_s()
    result = run_train(
        tmp_path,
        f"model.path={micro_model_dir}",
        "data.train_files=[train.jsonl]",
        "data.val_files=[val.jsonl]",
        "reward.function=math",
        "--output-dir",
        "out",
        cold=True,  # a process of the test's own, so that its CPU time is the test's children's
    )
    cpu_s = _children_cpu_s() - started  # the run's CPU time: a neighbour's load leaves it be
    line = error_line(result)
    assert "train.jsonl:2: the prompt has at least" in line
    assert "5000000 characters" in line and "rollout.max_seq_len=512" in line
    # the run takes 6.5-8.7 CPU-s on the 2-core VM (most of it imports; the more with another
    # load beside it); tokenizing the prompt would add 9 CPU-s and 2 GB
    assert cpu_s < 13, cpu_s
    assert not (tmp_path / "out").exists()
