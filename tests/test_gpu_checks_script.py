"""benchmarks/gpu_checks.py, the one script for a lent GPU, runs end to end in its tiny CPU
mode, so that it still works on the day a GPU is lent."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_the_gpu_script_runs_its_checks_on_a_tiny_model(tmp_path):
    out = tmp_path / "gpu_checks"
    subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_checks", "--device", "cpu", "--size", "tiny"]
        + ["--out", str(out)],
        check=True,
        cwd=ROOT,
        capture_output=True,
    )
    record = json.loads(out.with_suffix(".json").read_text())
    assert record["generation"]["tokens"] > 0
    assert record["long_generation_self_draft_k4"]["rollout/spec_accept_rate"] > 0.99
    assert record["training"]["tokens_per_s"] > 0 and record["training"]["mfu"] > 0
    assert set(record["full_step_memory"]) == {"offload_off", "offload_on", "fsdp_param_offload"}
    assert "MFU" in out.with_suffix(".md").read_text()
    experts = record["expert_parallel"]  # through the dispatch, every expert on one rank
    assert experts["expert_parallel_s"] > 0 and experts["logit_gap"] < 1e-4


@pytest.mark.slow
def test_the_gpu_script_s_vllm_part_runs_colocated_on_a_cpu(vllm_model_dir):
    """The vLLM checks (benchmarks/gpu_vllm.py) in their CPU mode: vLLM in process takes a
    perturbed policy's weights and samples with them (fp32: the gap is rounding)."""
    pytest.importorskip("vllm")
    import torch

    from benchmarks.gpu_vllm import colocated

    result = colocated(vllm_model_dir, torch.device("cpu"))
    assert result["tokens_per_s"] > 0 and result["sync_s"] > 0
    assert result["logprob_gap_max"] < 1e-3
