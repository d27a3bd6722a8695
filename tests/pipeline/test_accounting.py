"""A failed score under ``reward.on_error=fail`` ends the run with one line naming the function
and its error (the counts under ``zero`` and ``drop``: ``test_loop_logic``)."""

import json

from honing.cli import main

FLAKY_REWARD = """
def flaky(response, ground_truth, **context):
    if len(response) % 2 == 0:
        raise ValueError("even-length answer")
    return 1.0 if len(response) == 1 else 0.0
"""


def run(tmp_path, micro_model_dir, policy):
    reward = tmp_path / "flaky.py"
    reward.write_text(FLAKY_REWARD)
    out = tmp_path / policy
    status = main(
        [
            "train",
            f"model.path={micro_model_dir}",
            f"reward.function={reward}:flaky",
            f"reward.on_error={policy}",
            "trainer.total_steps=3",
            "trainer.val_every=0",
            "trainer.val_at_start=false",
            "rollout.batch_size=4",
            "rollout.group_size=4",
            "rollout.max_new_tokens=4",
            "rollout.val_samples=1",
            "data.train_size=50",
            "data.val_size=4",
            "monitor.console=false",
            "monitor.tensorboard=false",
            "--output-dir",
            str(out),
        ]
    )
    path = out / "metrics.jsonl"
    return status, [json.loads(line) for line in path.open()] if path.exists() else []


def test_fail_policy_stops_with_one_line(tmp_path, micro_model_dir, capsys):
    status, _ = run(tmp_path, micro_model_dir, "fail")
    assert status == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("honing: error: reward function")
    assert "even-length answer" in err[-1]
