"""``torchrun --nproc_per_node 2 -m honing.cli train``: two CPU ranks (gloo) train the same
step as one process does: same batch, same loss, the same weights within float tolerance."""

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from ._configs import BASE

OVERRIDES = BASE | {
    "rollout.batch_size": 4,
    "trainer.val_at_start": False,
    "trainer.threads": 1,
    "trainer.lr": 1e-2,
    "trainer.micro_batch_size": 2,
    "algorithm.kl_coef": 0.05,
}


def train(tmp_path, name, model_dir, reward, ranks: int, steps: int):
    values = OVERRIDES | {
        "model.path": model_dir,
        "reward.function": reward,
        "trainer.total_steps": steps,
    }
    command = ["-m", "honing.cli", "train", *(f"{k}={v}" for k, v in values.items())]
    command += ["--output-dir", str(tmp_path / name), "--resume", "never"]
    if ranks > 1:
        launcher = ["-m", "torch.distributed.run", "--nproc_per_node", str(ranks)]
        launcher += ["--standalone"]  # a local rendezvous on a free port
        command = launcher + command
    result = subprocess.run([sys.executable, *command], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
    metrics = [m for m in map(json.loads, lines) if m["step"] >= 1]
    weights = load_file(tmp_path / name / "checkpoints" / f"step_{steps}" / "model.safetensors")
    return metrics, weights


@pytest.mark.slow
def test_two_ranks_train_the_step_one_process_does(tmp_path, micro_model_dir, digit_reward):
    one, one_weights = train(tmp_path, "one", micro_model_dir, digit_reward, ranks=1, steps=1)
    two, two_weights = train(tmp_path, "two", micro_model_dir, digit_reward, ranks=2, steps=1)
    assert one[0]["critic/score/mean"] == two[0]["critic/score/mean"]  # the same batch
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/entropy"):
        assert two[0][key] == pytest.approx(one[0][key], rel=1e-4, abs=1e-6), key
    assert one_weights.keys() == two_weights.keys()
    for name, want in one_weights.items():
        torch.testing.assert_close(two_weights[name], want, atol=1e-5, rtol=1e-4)
