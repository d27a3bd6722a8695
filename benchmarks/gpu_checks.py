"""Every GPU measurement of honing in one script, short enough for a 15-minute GPU slot.

On a random ~0.5B Qwen2 configuration (Qwen2-0.5B's shape: hidden 896, 24 layers, 14 heads,
2 KV heads, MLP 4864, vocabulary 151,936, tied embeddings) in bfloat16, with random weights
(throughput does not depend on them):

1. generation tokens/s of honing's engine: 64 sequences x 256 new tokens, and long outputs,
   16 sequences x 1,024 new tokens (EOS suppressed by random weights: full length);
2. the same long outputs with speculation: prompt lookup k = 4 under the automatic switch
   (random text: the drafts are rejected, so this measures what a bad draft costs), and the
   policy as its own draft k = 4 (every draft accepted: the verify pass's efficiency);
3. training tokens/s and model-FLOPs utilisation of one update (64 sequences x 512 tokens,
   micro-batches of 8, float32 master weights with bf16 autocast): MFU = 6 N tokens/s / peak;
4. peak device memory of one full training step (generation, then the update) with and
   without ``memory.dynamic_offload`` (threshold forced low so that it acts), and under
   ``trainer.strategy=fsdp`` with ``memory.param_offload`` on the one device (FSDP2 over a
   group of one, parameters and optimizer step on the host), with its step time;
5. with vLLM installed (on CUDA): vLLM in process and a vLLM server with NCCL weight transfer,
   each with its tokens/s, a weight sync's time and the logprob gap after it, and vLLM in
   every torchrun rank (one per GPU, FSDP, sleep mode around the updates) with its step time,
   logprob gap and peak memory (``benchmarks/gpu_vllm.py``);
6. the expert-parallel experts on the device (``benchmarks/gpu_parallel.py``): a random
   Qwen3-MoE's forward and backward through ``ExpertParallelExperts`` over a group of one
   rank (``grouped_mm`` in bfloat16 on CUDA) against its own experts, with the logit gap.
   Tensor and expert parallelism across ranks need a machine of several devices.

Writes benchmarks/results/gpu_checks.{json,md}. ``--size tiny --device cpu`` runs the same
code paths in seconds on a CPU (what the test suite does, so the script does not rot).

    .venv/bin/python -m benchmarks.gpu_checks [--device cuda] [--size 0.5b] [--peak-tflops 989]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.gpu_parallel import expert_parallel_one_rank

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
SIZES = {
    "0.5b": dict(hidden=896, layers=24, heads=14, kv=2, mlp=4864, vocab=151936),
    "tiny": dict(hidden=64, layers=2, heads=4, kv=2, mlp=128, vocab=1000),
}
WORK = {  # (gen rows, gen tokens, long rows, long tokens, train rows, train tokens)
    "0.5b": (64, 256, 16, 1024, 64, 512),
    "tiny": (16, 16, 8, 32, 8, 32),
}


def random_qwen2(directory: Path, size: str) -> Path:
    """A random Qwen2 model directory with honing's character tokenizer (ids < 100)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from honing.models.tiny import build_tokenizer

    shape = SIZES[size]
    tokenizer = build_tokenizer()
    config = Qwen2Config(
        vocab_size=shape["vocab"],
        hidden_size=shape["hidden"],
        intermediate_size=shape["mlp"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv"],
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def generation(model, tokenizer, device, rows: int, tokens: int, speculation=None) -> dict:
    from honing.rollout.base import GenerationRequest, SamplingParams
    from honing.rollout.native.engine import TransformersEngine

    engine = TransformersEngine(model, tokenizer, device=device, speculation=speculation)
    prompts = [GenerationRequest(f"p{i}", tokenizer.encode(f"{i} + {i} ="), i) for i in range(8)]
    params = SamplingParams(n=rows // 8, max_new_tokens=tokens, max_seq_len=tokens + 64)
    engine.generate(prompts[:1], SamplingParams(n=1, max_new_tokens=4))  # warm-up
    engine.take_report()
    sync(device)
    started = time.perf_counter()
    rollouts = engine.generate(prompts, params)
    sync(device)
    seconds = time.perf_counter() - started
    produced = sum(len(r.response_ids) for r in rollouts)
    report, _ = engine.take_report()
    return {
        "rows": rows,
        "max_new_tokens": tokens,
        "tokens": produced,
        "seconds": seconds,
        "tokens_per_s": produced / seconds,
        **{k: v for k, v in report.items() if k.startswith("rollout/spec_a")},
    }


def training(model, tokenizer, device, rows: int, tokens: int, peak_tflops: float) -> dict:
    from honing.rollout.native.fast_decode import unwrap
    from honing.trainer.batch import collate
    from honing.trainer.engine import TrainedModule
    from honing.trainer.optim import build_optimizer
    from honing.trainer.policy_update import UpdateSettings, update_policy
    from honing.types import Rollout

    policy = unwrap(model).float().train()
    optimizer, _ = build_optimizer(
        policy,
        lr=1e-6,
        weight_decay=0.0,
        betas=(0.9, 0.999),
        warmup_steps=0,
        total_steps=1,
        schedule="constant",
        min_ratio=0.0,
    )
    generator = torch.Generator().manual_seed(0)
    prompt = tokens // 8  # 64 prompt + 448 response tokens at the full size
    rollouts = [
        Rollout(
            f"p{i}",
            i,
            torch.randint(4, 90, (prompt,), generator=generator).tolist(),
            torch.randint(4, 90, (tokens - prompt,), generator=generator).tolist(),
            [0.0] * (tokens - prompt),
            "length",
            0,
            "",
        )
        for i in range(rows)
    ]
    batch = collate(rollouts, tokenizer.pad_token_id, device)
    advantages = torch.randn(batch.responses.shape, device=device)
    settings = UpdateSettings(
        micro_batch_size=8, autocast="bfloat16" if device.type == "cuda" else "none"
    )
    engine = TrainedModule("policy", policy, optimizer)
    update_policy(engine, batch, advantages, settings)  # warm-up (allocates Adam)
    sync(device)
    started = time.perf_counter()
    update_policy(engine, batch, advantages, settings)
    sync(device)
    seconds = time.perf_counter() - started
    params = sum(p.numel() for p in policy.parameters())
    per_s = rows * tokens / seconds
    flops = 6 * params * per_s
    return {
        "rows": rows,
        "tokens_per_row": tokens,
        "seconds": seconds,
        "tokens_per_s": per_s,
        "parameters": params,
        "model_tflops": flops / 1e12,
        "mfu": flops / (peak_tflops * 1e12),
    }


def full_step_memory(
    model_dir: Path, device: torch.device, size: str, offload: bool, extra: dict | None = None
) -> dict:
    from honing.backends.launch import train
    from honing.config import build_config

    gen_rows, gen_tokens = WORK[size][0], WORK[size][1]
    config = build_config(
        {
            "model.path": str(model_dir),
            "model.device": device.type,
            "trainer.autocast": "bfloat16" if device.type == "cuda" else "none",
            "rollout.engine": "transformers",  # honing's own engine's memory (vLLM: item 5)
            "rollout.batch_size": 8,
            "rollout.group_size": gen_rows // 8,
            "rollout.max_new_tokens": gen_tokens,
            "rollout.val_samples": 1,
            "data.val_size": 8,
            "trainer.total_steps": 2,
            "trainer.val_at_start": False,
            "trainer.val_every": 0,
            "trainer.micro_batch_size": 8,
            "checkpoint.every": 0,
            "monitor.console": False,
            "monitor.tensorboard": False,
            "memory.dynamic_offload": offload,
            "memory.offload_trigger_threshold": 0.001,
            "reward.function": "numeric",
        }
        | (extra or {})
    )
    with tempfile.TemporaryDirectory() as run_dir:
        train(config, Path(run_dir) / "run", resume="never", log=lambda m: None)
        lines = (Path(run_dir) / "run" / "metrics.jsonl").read_text().splitlines()
        last = [json.loads(line) for line in lines][-1]  # step 2: the optimizer state exists
    return {
        key: last.get(key)
        for key in (
            "memory/peak_gen_gb",
            "memory/peak_update_gb",
            "memory/offloaded_gb",
            "timing_s/offload",
            "timing_s/reload",
            "timing_s/step",
            "memory/model_state_mb",
        )
    }


def vllm_checks(model_dir: Path, device: torch.device) -> dict:
    """benchmarks/gpu_vllm.py's checks, each one's failure recorded beside the others'
    results rather than losing them."""
    from benchmarks.gpu_vllm import colocated, in_ranks, server

    record: dict = {}
    in_ranks_dir = model_dir.parent / "vllm_in_ranks"
    for name, check in (
        ("colocated", colocated),
        ("server", server),
        ("in_ranks", lambda model, on: in_ranks(model, on, in_ranks_dir)),
    ):
        torch.cuda.empty_cache()
        try:
            record[name] = check(model_dir, device)
        except Exception as err:  # noqa: BLE001 - a device run's other figures are kept
            record[name] = {"error": f"{type(err).__name__}: {err}"[:500]}
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--size", default="0.5b", choices=tuple(SIZES))
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="bf16 dense peak")
    parser.add_argument("--out", default=str(RESULTS / "gpu_checks"))
    args = parser.parse_args()
    from honing.models.loading import load_causal_lm, load_tokenizer
    from honing.rollout.native.speculative import Speculation

    device = torch.device(args.device)
    gen_rows, gen_tokens, long_rows, long_tokens, train_rows, train_tokens = WORK[args.size]
    record: dict = {
        "command": f"python -m benchmarks.gpu_checks --device {args.device} --size {args.size}",
        "machine": platform.platform(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
    }
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = random_qwen2(Path(tmp) / "model", args.size)
        tokenizer = load_tokenizer(model_dir)
        model = load_causal_lm(model_dir, tokenizer, dtype="bfloat16", device=device).eval()
        record["generation"] = generation(model, tokenizer, device, gen_rows, gen_tokens)
        record["long_generation"] = generation(model, tokenizer, device, long_rows, long_tokens)
        bad = Speculation("ngram", 4, 0.3, 20)
        record["long_generation_ngram_k4_auto"] = generation(
            model, tokenizer, device, long_rows, long_tokens, bad
        )
        itself = Speculation("draft", 4, 0.0, 20, model)
        record["long_generation_self_draft_k4"] = generation(
            model, tokenizer, device, long_rows, long_tokens, itself
        )
        del model
        model = load_causal_lm(model_dir, tokenizer, dtype="float32", device=device)
        record["training"] = training(
            model, tokenizer, device, train_rows, train_tokens, args.peak_tflops
        )
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
        sharded = {"trainer.strategy": "fsdp", "memory.param_offload": True}
        record["full_step_memory"] = {
            "offload_off": full_step_memory(model_dir, device, args.size, False),
            "offload_on": full_step_memory(model_dir, device, args.size, True),
            # FSDP2 over one device with its parameters on the host (CPU: trains whole)
            "fsdp_param_offload": full_step_memory(model_dir, device, args.size, False, sharded),
        }
        if device.type == "cuda" and importlib.util.find_spec("vllm") is not None:
            record["vllm"] = vllm_checks(model_dir, device)
        record["expert_parallel"] = expert_parallel_one_rank(device, args.size)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(record, indent=1))
    lines = [f"# GPU checks ({record['device']})", "", f"`{record['command']}`", ""]
    for key in (
        "generation",
        "long_generation",
        "long_generation_ngram_k4_auto",
        "long_generation_self_draft_k4",
    ):
        g = record[key]
        lines.append(
            f"- {key}: {g['rows']} x {g['max_new_tokens']} tokens, "
            f"{g['tokens_per_s']:.0f} tokens/s"
            + (
                f", acceptance {g['rollout/spec_accept_rate']:.2f}"
                if "rollout/spec_accept_rate" in g
                else ""
            )
        )
    t = record["training"]
    lines.append(
        f"- training: {t['rows']} x {t['tokens_per_row']} tokens, {t['tokens_per_s']:.0f} "
        f"tokens/s, {t['model_tflops']:.1f} model TFLOP/s, MFU {t['mfu']:.1%} of "
        f"{args.peak_tflops:g} TFLOP/s"
    )
    for name, memory in record["full_step_memory"].items():
        lines.append(f"- full step, {name}: " + ", ".join(f"{k} {v}" for k, v in memory.items()))
    for name, figures in record.get("vllm", {}).items():
        lines.append(f"- vLLM {name}: " + ", ".join(f"{k} {v}" for k, v in figures.items()))
    figures = record["expert_parallel"]
    lines.append(
        "- expert-parallel experts, one rank: " + ", ".join(f"{k} {v}" for k, v in figures.items())
    )
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
