"""vLLM in every torchrun rank (``rollout.engine=vllm`` under torchrun), for real: two gloo
ranks train what one process with vLLM trains, whether each rank samples its share of the
batch with a vLLM engine of its own (FSDP: each engine takes the weights bucket by bucket from
the gather) or both share one vLLM engine tensor-parallel over them (``rollout.tensor_parallel
=2``, replicated). vLLM seeds each request by its index in the whole call, so the samples do
not depend on how the batch is dealt to the ranks."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]')")

from honing.errors import ConfigError  # noqa: E402
from honing.pipeline.rules import check_config  # noqa: E402
from tests import warm  # noqa: E402

from ._configs import BASE, small_run_config  # noqa: E402

pytestmark = pytest.mark.slow

# fp32 everywhere: the ranks' gradient sums and one process's differ in rounding (~5e-5 after
# 2 steps at this learning rate, measured); a sample that differed would move them by far more
WEIGHTS = 1e-4
# the engines' and the trainer's logprobs of the same tokens (~6e-7 measured); a rank whose
# engine missed an update is off by 0.02-0.2 nats at this learning rate
GAP = 1e-4
RUN = BASE | {
    "rollout.batch_size": 4,
    "rollout.engine": "vllm",
    "rollout.vllm_kv_cache_mb": 16,
    "rollout.max_seq_len": 64,
    "rollout.temperature": 0.8,
    "pipeline.rollout_chunk": 1,  # four tasks: both ranks sample
    "trainer.lr": 1e-2,
    "trainer.micro_batch_size": 2,
    "trainer.threads": 1,
    "trainer.val_at_start": False,
    "trainer.total_steps": 2,
    "checkpoint.every": 2,
}


def _run(tmp_path, name, model_dir, reward, ranks, **overrides):
    """``honing train`` on ``ranks`` torchrun ranks (1: one process): the metrics of its
    steps and the last checkpoint's weights."""
    values = RUN | {"model.path": model_dir, "reward.function": reward} | overrides
    args = ["train", *(f"{k}={v}" for k, v in values.items()), "--output-dir", tmp_path / name]
    command = warm.torchrun(ranks, *args) if ranks > 1 else warm.honing(*args)
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
    steps = [m for m in map(json.loads, lines) if "samples/generated" in m]
    weights = {}
    for shard in (tmp_path / name / "checkpoints" / "step_2").glob("*.safetensors"):
        weights |= load_file(shard)
    return steps, weights


def test_vllm_in_each_rank_trains_what_one_process_with_vllm_does(
    tmp_path, vllm_model_dir, digit_reward
):
    args = (vllm_model_dir, digit_reward)
    one, one_weights = _run(tmp_path, "one", *args, 1)
    sharded, sharded_weights = _run(tmp_path, "fsdp", *args, 2, **{"trainer.strategy": "fsdp"})
    shared, shared_weights = _run(tmp_path, "tp", *args, 2, **{"rollout.tensor_parallel": 2})
    for steps, ranks in ((sharded, 2.0), (shared, 1.0)):  # one slot of two ranks under TP
        assert [m["rollout/generation_ranks"] for m in steps] == [ranks, ranks]
        for mine, theirs in zip(steps, one, strict=True):
            assert mine["critic/score/mean"] == theirs["critic/score/mean"]  # the same samples
            assert mine["response_length/mean"] == theirs["response_length/mean"]
            assert mine["rollout_mismatch/logprob_diff_max"] < GAP, mine
    for weights in (sharded_weights, shared_weights):
        for name, want in one_weights.items():
            if name in weights:  # a tied head is listed by some exports only
                torch.testing.assert_close(weights[name], want, atol=WEIGHTS, rtol=0)
    assert sharded[-1]["perf/sync_mb"] > 0


@pytest.mark.parametrize(
    ("overrides", "world_size", "message"),
    [
        ({"rollout.tensor_parallel": 2}, 1, "launch a multiple of 2"),
        ({"rollout.tensor_parallel": 2, "pipeline.spread_generation": False}, 2, "spread_gen"),
        ({"rollout.tensor_parallel": 2, "schedule.mode": "async"}, 2, "schedule.mode=sync"),
        ({"rollout.tensor_parallel": 2, "rollout.engine": "transformers"}, 2, "applies to"),
    ],
)
def test_what_a_tensor_parallel_engine_needs_is_one_line(
    vllm_model_dir, overrides, world_size, message
):
    config = small_run_config(vllm_model_dir, "auto", **{"rollout.engine": "vllm"} | overrides)
    with pytest.raises(ConfigError, match=message):
        check_config(config, world_size)
