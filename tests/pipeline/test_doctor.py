"""``honing doctor``: a table of checks and one real step; failures are rows, not tracebacks."""

from honing.cli import main


def _args(micro_model_dir, digit_reward, *extra):
    return [
        "doctor",
        f"model.path={micro_model_dir}",
        f"reward.function={digit_reward}",
        "rollout.batch_size=2",
        "rollout.group_size=2",
        "rollout.max_new_tokens=3",
        *extra,
    ]


def test_healthy_setup_passes_every_check_and_runs_one_step(
    micro_model_dir, digit_reward, tmp_path, capsys
):
    status = main(_args(micro_model_dir, digit_reward, "--output-dir", str(tmp_path / "runs")))
    out = capsys.readouterr().out
    assert status == 0, out
    rows = {line.split()[1]: line.split()[0] for line in out.splitlines()[:-1]}
    assert rows["config"] == rows["data"] == rows["reward"] == rows["model"] == "ok"
    assert rows["one"] == "ok" and "generated 4, trained 4" in out
    assert "pad '<pad>' != eos '<eos>'" in out
    assert not (tmp_path / "runs").exists()  # nothing written


def test_failures_are_rows_and_the_status_is_1(micro_model_dir, digit_reward, tmp_path, capsys):
    status = main(
        _args(
            micro_model_dir,
            digit_reward,
            f"data.train_files=[{tmp_path / 'missing.jsonl'}]",
            f"data.val_files=[{tmp_path / 'missing.jsonl'}]",
            "reward.endpoint=http://127.0.0.1:9",
        )
    )
    out = capsys.readouterr().out
    assert status == 1
    lines = {line.split()[1]: line for line in out.splitlines()[:-1]}
    assert lines["data"].startswith("FAIL") and "missing.jsonl" in lines["data"]
    assert lines["service"].startswith("FAIL") and "ConnectError" in lines["service"]
    assert lines["model"].startswith("skip") and lines["one"].startswith("skip")
    assert out.splitlines()[-1].endswith("2 failed")


def test_an_unreachable_rollout_server_is_a_row(micro_model_dir, digit_reward, capsys):
    extra = ("rollout.engine=openai", "rollout.endpoints=http://127.0.0.1:9/v1")
    assert main(_args(micro_model_dir, digit_reward, *extra)) == 1
    out = capsys.readouterr().out
    [row] = [line for line in out.splitlines() if "rollout server" in line]
    assert row.startswith("FAIL") and "http://127.0.0.1:9/v1" in row and "ConnectError" in row
