"""A run on a verl-style file mixing math and code rows: ``reward.function=auto`` sends each
row to its verifier in process (math worker pool, code sandbox) and the run completes."""

import json

from honing.backends.launch import train
from tests.pipeline._configs import small_run_config

ROWS = [
    {"data_source": "openai/gsm8k", "prompt": "1+1=", "reward_model": {"ground_truth": "2"}},
    {"data_source": "lighteval/MATH", "prompt": "1/2=", "reward_model": {"ground_truth": "0.5"}},
    {
        "data_source": "codecontests",
        "prompt": "echo:",
        "reward_model": {"ground_truth": json.dumps({"inputs": ["3\n"], "outputs": ["3\n"]})},
    },
    {
        "data_source": "mbpp",
        "prompt": "f=",
        "reward_model": {"ground_truth": {"test_code": "assert f(1) == 2", "entry_point": "f"}},
    },
]


def test_math_and_code_rows_score_through_their_verifiers(micro_model_dir, tmp_path):
    data = tmp_path / "mixed.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    config = small_run_config(
        micro_model_dir,
        "auto",
        **{
            "data.train_files": [str(data)],
            "data.val_files": [str(data)],
            "rollout.batch_size": 4,
            "rollout.group_size": 2,
            "trainer.total_steps": 1,
            "monitor.log_samples": 8,
            "reward.workers": 1,
            "reward.code_timeout_s": 5.0,
        },
    )
    train(config, tmp_path / "run", resume="never", log=lambda message: None)
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").open()]
    verdicts = {s["verdict"] for s in samples}
    assert verdicts & {"correct", "wrong", "no_answer", "unparsable"}  # the math verifier
    assert verdicts & {"passed", "failed", "no_code"}  # the code verifier
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert metrics[-1]["samples/score_errors"] == 0
