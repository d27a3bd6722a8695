"""vLLM on the device: the part of benchmarks/gpu_checks.py that runs ``rollout.engine=vllm``
(colocated: vLLM's ``LLM`` in this process) and a vLLM server trained through its RL API
(``rollout.weight_sync=vllm``): vLLM's NCCL transfer where the server has a GPU of its own,
honing's shared-memory transfer where it shares the one GPU with the trainer.

For each: generation tokens/s, the time of one weight sync (the policy's tensors, perturbed,
in the trainer's buckets), and the largest gap between the logprobs vLLM recorded for sampled
tokens and the policy's own for those tokens after the sync (bfloat16 on CUDA: ~1e-2 nats is
rounding; a weight that did not arrive shows as far more). Colocated with sleep mode, also the
device's free memory with vLLM awake and asleep.

    .venv/bin/python -m benchmarks.gpu_vllm --model DIR [--device cuda]

``--device cpu`` runs the colocated part on a CPU (float32), so the code paths are exercised
without a GPU (the test suite does); the server part runs on CUDA only. ``in_ranks`` runs
vLLM in every torchrun rank (``rollout.engine=vllm`` under FSDP, sleep mode on CUDA): one rank
per GPU, or two gloo ranks on a CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from honing.models.loading import load_causal_lm, load_tokenizer, plain_weight_items
from honing.rollout.base import GenerationRequest, SamplingParams
from honing.trainer.batch import collate, response_logprobs
from honing.trainer.engine import BUCKET_BYTES, buckets

ROWS, TOKENS = 8, 64  # prompts x 8 samples, new tokens


def _requests(tokenizer) -> list[GenerationRequest]:
    texts = [f"{a}+{b}=" for a, b in zip(range(10, 90, 10), range(7, 15), strict=True)]
    return [
        GenerationRequest(f"p{i}", tokenizer.encode(t, add_special_tokens=False), i)
        for i, t in enumerate(texts[:ROWS])
    ]


def _perturb(policy) -> None:
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in policy.parameters():
            noise = torch.randn(param.shape, generator=generator).to(param.device, param.dtype)
            param.mul_(1.0 + 0.05 * noise)


def _measure(engine, policy, tokenizer, device) -> dict:
    """tokens/s of one call, then a sync of the perturbed policy and the logprob gap after."""
    limit = min(TOKENS + 32, policy.config.max_position_embeddings)
    params = SamplingParams(n=8, max_new_tokens=TOKENS, max_seq_len=limit, seed=1)
    engine.generate(_requests(tokenizer), params)  # warm-up
    started = time.perf_counter()
    rollouts = engine.generate(_requests(tokenizer), params)
    seconds = time.perf_counter() - started
    _perturb(policy)
    began = time.perf_counter()
    engine.load_weights(1, buckets(plain_weight_items(policy), BUCKET_BYTES))
    sync_s = time.perf_counter() - began
    rollouts = engine.generate(_requests(tokenizer), params)
    batch = collate(rollouts, tokenizer.pad_token_id, device)
    with torch.no_grad():
        trainer, _ = response_logprobs(policy, batch)
    gap = ((trainer - batch.behaviour_logprobs).abs() * batch.response_mask).max()
    return {
        "tokens_per_s": sum(len(r.response_ids) for r in rollouts) / seconds,
        "sync_s": sync_s,
        "logprob_gap_max": float(gap),
    }


def colocated(model_dir: Path, device: torch.device) -> dict:
    from honing.rollout.vllm.engine import VLLMEngine, VLLMSettings

    dtype = "bfloat16" if device.type == "cuda" else "float32"
    tokenizer = load_tokenizer(model_dir)
    policy = load_causal_lm(model_dir, tokenizer, dtype=dtype, device=device).eval()
    settings = VLLMSettings(
        kv_cache_mb=0 if device.type == "cuda" else 256,
        gpu_memory_utilization=0.3,
        sleep=device.type == "cuda",
        dtype=dtype,
    )
    engine = VLLMEngine(
        model_dir,
        tokenizer,
        stop_ids={tokenizer.eos_token_id},
        max_seq_len=min(TOKENS + 32, policy.config.max_position_embeddings),
        settings=settings,
        device_type=device.type,
        weights=buckets(plain_weight_items(policy), BUCKET_BYTES),
        vocab_size=policy.get_input_embeddings().weight.shape[0],
    )
    result = {"start_s": engine.start_seconds} | _measure(engine, policy, tokenizer, device)
    if device.type == "cuda":  # free device memory with vLLM awake, and asleep (sleep mode)
        engine.llm.wake_up()
        result["device_free_mb_awake"] = torch.cuda.mem_get_info()[0] / 2**20
        engine.llm.sleep(level=1)
        result["device_free_mb_asleep"] = torch.cuda.mem_get_info()[0] / 2**20
    engine.close()
    return result


def server(model_dir: Path, device: torch.device, port: int = 8011) -> dict:
    """A vLLM server trained through honing's OpenAIEngine (``weight_sync=vllm``): with two
    GPUs or more, on its own GPU with vLLM's NCCL transfer (NCCL takes one rank a device);
    with one, beside the trainer on it with honing's shared-memory transfer."""
    from honing.errors import UserError
    from honing.rollout.remote.engine import OpenAIEngine

    two = torch.cuda.device_count() >= 2
    backend = "nccl" if two else "honing"
    tokenizer = load_tokenizer(model_dir)
    policy = load_causal_lm(model_dir, tokenizer, dtype="bfloat16", device=device).eval()
    env = os.environ | {"VLLM_SERVER_DEV_MODE": "1"}
    if two:
        env["CUDA_VISIBLE_DEVICES"] = "1"
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model"]
    command += [str(model_dir), "--port", str(port), "--dtype", "bfloat16"]
    command += ["--gpu-memory-utilization", "0.3", "--logprobs-mode", "processed_logprobs"]
    command += ["--return-tokens-as-token-ids", "--enforce-eager"]
    command += ["--weight-transfer-config", json.dumps({"backend": backend})]
    process = subprocess.Popen(command, env=env)
    try:
        deadline = time.time() + 300
        while True:
            try:
                engine = OpenAIEngine(
                    [f"http://127.0.0.1:{port}"],
                    tokenizer,
                    weight_sync="vllm",
                    model_dir=str(model_dir),
                )
                break
            except UserError:  # the server answers and refuses: waiting will not help
                raise
            except Exception:
                if time.time() > deadline or process.poll() is not None:
                    raise
                time.sleep(5)
        result = {"backend": backend} | _measure(engine, policy, tokenizer, device)
        engine.close()
        return result
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()


def in_ranks(model_dir: Path, device: torch.device, out: Path, steps: int = 3) -> dict:
    """vLLM in every torchrun rank: ``honing train`` with ``rollout.engine=vllm`` and the
    policy sharded (FSDP) over one rank per GPU (two gloo ranks on a CPU), vLLM's sleep
    mode around each update on CUDA; the steps' median time, the ranks that sampled, the
    largest rollout/trainer logprob gap (the weights each engine took from the gather) and
    the peak device memory of a rank."""
    ranks = max(torch.cuda.device_count(), 1) if device.type == "cuda" else 2
    cuda = device.type == "cuda"
    values = {
        "model.path": model_dir,
        "model.device": device.type,
        "model.dtype": "bfloat16" if cuda else "float32",
        "rollout.engine": "vllm",
        "rollout.vllm_sleep": cuda,
        "rollout.vllm_gpu_memory_utilization": 0.3,
        "rollout.vllm_kv_cache_mb": 0 if cuda else 64,
        "rollout.batch_size": 8,
        "rollout.group_size": 4,
        "rollout.max_new_tokens": TOKENS,
        "rollout.max_seq_len": TOKENS + 32,
        "pipeline.rollout_chunk": 2,
        "trainer.strategy": "fsdp",
        "trainer.total_steps": steps,
        "trainer.val_at_start": False,
        "trainer.val_every": 0,
        "checkpoint.every": 0,
        "monitor.console": False,
        "monitor.tensorboard": False,
    }
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc_per_node", str(ranks), "-m", "honing.cli", "train"]
    command += [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in values.items()]
    command += ["--output-dir", str(out), "--resume", "never"]
    log = out.with_suffix(".log")
    with log.open("w") as sink:
        done = subprocess.run(command, stdout=sink, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise RuntimeError(f"torchrun exited {done.returncode}: {log.read_text()[-2000:]}")
    lines = (out / "metrics.jsonl").read_text().splitlines()
    metrics = [m for m in map(json.loads, lines) if "samples/generated" in m]
    later = metrics[1:] or metrics
    return {
        "ranks": ranks,
        "step_s": sorted(m["timing_s/step"] for m in later)[len(later) // 2],
        "generation_ranks": metrics[-1].get("rollout/generation_ranks", 1.0),
        "logprob_gap_max": max(m["rollout_mismatch/logprob_diff_max"] for m in metrics),
        # CUDA: rank 0's peak allocation while generating and while updating
        "peak_gen_gb": max(m.get("memory/peak_gen_gb", 0.0) for m in metrics),
        "peak_update_gb": max(m.get("memory/peak_update_gb", 0.0) for m in metrics),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    device = torch.device(args.device)
    report = {"colocated": colocated(args.model, device)}
    if device.type == "cuda":
        report["server"] = server(args.model, device)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
