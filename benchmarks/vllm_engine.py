"""vLLM in process (``rollout.engine=vllm``) against honing's own engine, side by side.

``speed``: generation tokens/s of both engines on random Qwen2-shaped models of ~0.87M, ~40M
and ~0.5B parameters (the last with Qwen2.5-0.5B's dimensions and vocabulary, tied
embeddings), fp32, 32-token prompts, groups of 8 and 16, responses of 64 and 512 tokens (no
stop token: every response is full length). Each engine runs in a process of its own; the
processes alternate, ``--rounds`` times; each takes one call per workload to warm up, then
``--calls`` calls, whose median is its figure. The vLLM process also times a weight sync
(the model's own tensors, in the trainer's 256 MB buckets) and samples its resident memory
meanwhile: the peak above the level before the sync is the sync's extra memory.

``step``: `honing train` on the grpo_step benchmark's ~47M-parameter Qwen2 (8 prompts x 8,
128 new tokens) with each engine, alternating; the medians over the steps after the first of
the step, generation and sync times.

``demo``: the demo (examples/arithmetic.yaml, 500 steps) with each engine: greedy val accuracy
at start and end.

    .venv/bin/python -m benchmarks.vllm_engine speed [--rounds 2] [--calls 3]
    .venv/bin/python -m benchmarks.vllm_engine step [--rounds 2] [--steps 4]
    .venv/bin/python -m benchmarks.vllm_engine demo

Each writes benchmarks/results/vllm_<command>.{json,md}. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from benchmarks.grpo_step import (
    M50,
    SEED,
    WORK,
    Workload,
    honing_overrides,
    revision,
    save_results,
)
from benchmarks.grpo_workloads import ModelSpec, alternating, build_model_dir, peer_data

ROOT = Path(__file__).resolve().parent.parent
ENGINES = ("transformers", "vllm")
MODELS = {  # name: (spec, prompts per call)
    "0.87M": (ModelSpec("q087", 128, 4, 4, 4, 384, vocab_size=99, max_positions=1024), 8),
    "40M": (ModelSpec("q40", 512, 8, 8, 2, 1536, vocab_size=32768, max_positions=1024), 4),
    "0.5B": (ModelSpec("q05b", 896, 24, 14, 2, 4864, vocab_size=151936, max_positions=1024), 1),
}
GROUPS, LENGTHS, PROMPT_TOKENS = (8, 16), (64, 512), 32
STEP_SHAPES = {  # name: (spec, prompts, group, new tokens) of the ``step`` workloads
    "47M": (M50, 8, 8, 128),
    "0.5B": (MODELS["0.5B"][0], 4, 8, 64),
}
PHASES = ("gen", "reward", "old", "update", "sync")


def _engine(name: str, model_dir: Path):
    """The engine ``name`` on ``model_dir`` with no stop token; and the model it needs."""
    import torch

    from honing.models.loading import load_causal_lm, load_tokenizer
    from honing.rollout.base import Holding
    from honing.rollout.native.engine import TransformersEngine
    from honing.rollout.vllm.engine import VLLMEngine, VLLMSettings
    from honing.trainer.engine import BUCKET_BYTES, buckets

    tokenizer = load_tokenizer(model_dir)
    model = load_causal_lm(model_dir, tokenizer, dtype="float32", device=torch.device("cpu"))
    model.eval().requires_grad_(False)
    if name == "transformers":
        engine = TransformersEngine(
            model, tokenizer, device=torch.device("cpu"), holds=Holding.SHARED
        )
        engine.stop_ids = set()
        return engine, model
    engine = VLLMEngine(
        model_dir,
        tokenizer,
        stop_ids=set(),
        max_seq_len=1024,
        settings=VLLMSettings(kv_cache_mb=1024, max_num_seqs=256),
        weights=buckets(model.state_dict().items(), BUCKET_BYTES),
        vocab_size=model.get_input_embeddings().weight.shape[0],
    )
    return engine, model


def _rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _sync(engine, model) -> dict:
    """One weight sync of the model's own tensors, timed, with the peak extra resident memory
    sampled every 2 ms."""
    from honing.trainer.engine import BUCKET_BYTES, buckets

    baseline, peak, done = _rss_mb(), [0.0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss_mb())
            time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    started = time.perf_counter()
    engine.load_weights(1, buckets(model.state_dict().items(), BUCKET_BYTES))
    seconds = time.perf_counter() - started
    done.set()
    sampler.join()
    model_mb = sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 2**20
    return {"sync_s": seconds, "sync_extra_mb": peak[0] - baseline, "model_mb": model_mb}


def child(engine_name: str, model_name: str, calls: int) -> dict:
    """In a process of its own: the engine's tokens/s per workload (median of ``calls``)."""
    import random

    from honing.rollout.base import GenerationRequest, SamplingParams

    spec, prompts = MODELS[model_name]
    model_dir = WORK / "models" / spec.name
    started = time.perf_counter()
    engine, model = _engine(engine_name, model_dir)
    result: dict = {"start_s": time.perf_counter() - started, "workloads": {}}
    rng = random.Random(SEED)
    vocab = model.config.vocab_size
    requests = [
        GenerationRequest(f"p{i}", [rng.randrange(3, vocab) for _ in range(PROMPT_TOKENS)], i)
        for i in range(prompts)
    ]
    for group in GROUPS:
        for length in LENGTHS:
            params = SamplingParams(n=group, max_new_tokens=length, max_seq_len=1024, seed=1)
            rates = []
            for call in range(calls + 1):  # the first warms up
                began = time.perf_counter()
                rollouts = engine.generate(requests, params)
                seconds = time.perf_counter() - began
                tokens = sum(len(r.response_ids) for r in rollouts)
                if call:
                    rates.append(tokens / seconds)
            result["workloads"][f"g{group}_t{length}"] = statistics.median(rates)
    if engine_name == "vllm":
        result |= _sync(engine, model)
        engine.close()
    return result


def speed(args) -> dict:
    for spec, _ in MODELS.values():
        build_model_dir(spec, WORK / "models" / spec.name, SEED)
    runs: dict = {model: {engine: [] for engine in ENGINES} for model in MODELS}
    for model in MODELS:
        for round_index, engine in alternating(args.rounds, ENGINES):
            command = [sys.executable, "-m", "benchmarks.vllm_engine", "_child"]
            command += ["--engine", engine, "--model", model, "--calls", str(args.calls)]
            env = os.environ | {"VLLM_LOGGING_LEVEL": "ERROR", "TOKENIZERS_PARALLELISM": "false"}
            out = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
            if out.returncode != 0:
                raise RuntimeError(f"{model} {engine} failed:\n{out.stderr[-3000:]}")
            runs[model][engine].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"{model} round {round_index} {engine}: {runs[model][engine][-1]}", flush=True)
    return {"runs": runs, "calls": args.calls, "rounds": args.rounds}


def _train(engine: str, shape: str, steps: int, data: dict, out: Path) -> dict:
    spec, prompts, group, tokens = STEP_SHAPES[shape]
    work = Workload(f"{spec.name}_t{tokens}", spec, tokens, 0.0, steps, 1)
    overrides = {
        "rollout.batch_size": prompts,
        "rollout.group_size": group,
        "rollout.engine": engine,
    }
    command = [sys.executable, "-m", "honing.cli", "train"]
    command += [
        item
        for item in honing_overrides(work, WORK / "models" / spec.name, data, 2)
        if item.split("=")[0] not in overrides
    ]
    command += [f"{key}={value}" for key, value in overrides.items()]
    command += ["--output-dir", str(out), "--resume", "never"]
    subprocess.run(["rm", "-rf", str(out)], check=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.with_name(out.name + ".log").open("w") as sink:
        subprocess.run(command, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, check=True)
    lines = (out / "metrics.jsonl").read_text().splitlines()
    metrics = [m for m in map(json.loads, lines) if m.get("step", 0) >= 2 and "timing_s/gen" in m]
    keys = ["timing_s/step", *(f"timing_s/{phase}" for phase in PHASES)]
    figures = {key: statistics.median(m.get(key, 0.0) for m in metrics) for key in keys}
    figures["response_tokens"] = statistics.median(m["response_length/mean"] for m in metrics)
    figures["rollout_mismatch/logprob_diff_max"] = max(
        m.get("rollout_mismatch/logprob_diff_max", 0.0) for m in metrics
    )
    return figures


def step(args) -> dict:
    from benchmarks.step_flops import matmul_peaks, prompt_tokens

    data = peer_data(WORK, SEED)
    report: dict = {"shapes": {}, "rounds": args.rounds, "steps": args.steps}
    for shape in args.models.split(","):
        spec, prompts, group, tokens = STEP_SHAPES[shape]
        model_dir = WORK / "models" / spec.name
        build_model_dir(spec, model_dir, SEED)
        prompt = prompt_tokens(model_dir, data["train"])
        rows = prompts * group
        runs: dict = {engine: [] for engine in ENGINES}
        for round_index, engine in alternating(args.rounds, ENGINES):
            out = WORK / "runs" / "vllm_step" / f"{shape}_{round_index}_{engine}"
            runs[engine].append(_train(engine, shape, args.steps, data, out))
            print(f"{shape} round {round_index} {engine}: {runs[engine][-1]}", flush=True)
        report["shapes"][shape] = {
            "spec": spec.__dict__,
            "prompts": prompts,
            "group": group,
            "max_new_tokens": tokens,
            "prompt_tokens": prompt,
            "peaks": matmul_peaks(spec, rows, round(rows * (prompt + tokens))),
            "runs": runs,
        }
    return report


def demo(args) -> dict:
    runs = {}
    for engine in ENGINES:
        out = WORK / "runs" / "vllm_demo" / engine
        subprocess.run(["rm", "-rf", str(out)], check=True)
        command = [sys.executable, "-m", "honing.cli", "train", "examples/arithmetic.yaml"]
        command += [f"rollout.engine={engine}", "monitor.console=false"]
        command += ["--output-dir", str(out), "--resume", "never"]
        subprocess.run(command, cwd=ROOT, check=True, capture_output=True)
        summary = json.loads((out / "summary.json").read_text())
        lines = (out / "metrics.jsonl").read_text().splitlines()
        curve = [
            (m["step"], m["val/accuracy"]) for m in map(json.loads, lines) if "val/accuracy" in m
        ]
        runs[engine] = {
            "train_s": summary["seconds"],
            "val_accuracy": [summary["val_accuracy_start"], summary["val_accuracy_end"]],
            "pass_at_8": [summary["pass_at_k_start"], summary["pass_at_k_end"]],
            "curve": curve,
        }
        print(f"{engine}: {runs[engine]['val_accuracy']} in {summary['seconds']:.0f} s", flush=True)
    return {"runs": runs}


WORKLOADS = {
    "speed": "Random Qwen2-shaped models (fp32, tied embeddings), 32-token prompts: 8 prompts "
    "at 0.87M, 4 at 40M, 1 at 0.5B, each sampled g8 or g16 times, t64 or t512 new tokens "
    "(no stop token). Each engine in a process of its own, alternating; a warm-up call, then "
    "the median call. Sync: the model's own tensors in the trainer's 256 MB buckets into vLLM; "
    "sync extra MB: the peak resident memory above the level before the sync (the 0.5B model's "
    "545 MB embedding is a bucket of its own, sent under both tied names).",
    "step": "`honing train` with each engine on the grpo_step benchmark's ~47M-parameter Qwen2 "
    "(32k vocabulary; 8 prompts x 8, 128 new tokens) and on the 0.5B shape of `speed` (Qwen2.5-"
    "0.5B's dimensions, 152k vocabulary; 4 prompts x 8, 64 new tokens): fp32, 2 threads, one "
    "optimizer step per batch, no KL; the medians of the steps after the first. An engine with "
    "weights of its own has the update's forward give the engine/trainer gap "
    "(rollout_mismatch/*): no separate old-logprob pass runs.",
    "demo": "`honing train examples/arithmetic.yaml` (500 GRPO steps on the built-in tiny "
    "model) with each engine; greedy validation accuracy on 200 held-out problems.",
}


def markdown(command: str, report: dict) -> str:
    lines = [
        f"# vLLM in process against honing's engine: {command}",
        "",
        f"Machine: {report['machine']}; revision {report['revision']}; "
        f"`{report['command']}` ({report['wall_s']:.0f} s).",
        "",
        WORKLOADS[command],
        "",
    ]
    runs = report.get("runs", {})
    if command == "speed":
        lines += [
            "Generation tokens/s (median over rounds of each process's median call); ratio "
            "vLLM / honing.",
            "",
            "| model | workload | honing | vLLM | ratio |",
            "|---|---|---:|---:|---:|",
        ]
        for model, engines in runs.items():
            for work in engines["vllm"][0]["workloads"]:
                ours = statistics.median(r["workloads"][work] for r in engines["transformers"])
                theirs = statistics.median(r["workloads"][work] for r in engines["vllm"])
                lines.append(
                    f"| {model} | {work} | {ours:.0f} | {theirs:.0f} | {theirs / ours:.2f} |"
                )
        lines += [
            "",
            "| model | vLLM start s | sync s | sync extra MB | model MB |",
            "|---|---:|---:|---:|---:|",
        ]
        for model, engines in runs.items():
            v = engines["vllm"]
            med = {
                k: statistics.median(r[k] for r in v)
                for k in ("start_s", "sync_s", "sync_extra_mb", "model_mb")
            }
            lines.append(
                f"| {model} | {med['start_s']:.1f} | {med['sync_s']:.2f} | "
                f"{med['sync_extra_mb']:.0f} | {med['model_mb']:.0f} |"
            )
    elif command == "step":
        from benchmarks.step_flops import step_tables

        lines += step_tables(report)
    else:
        lines += ["| engine | greedy val accuracy | pass@8 | training s |", "|---|---|---|---:|"]
        for engine, r in runs.items():
            lines.append(
                f"| {engine} | {r['val_accuracy'][0]:.3f} → {r['val_accuracy'][1]:.3f} | "
                f"{r['pass_at_8'][0]:.3f} → {r['pass_at_8'][1]:.3f} | {r['train_s']:.0f} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=("speed", "step", "demo", "_child"))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--engine", choices=ENGINES)
    parser.add_argument("--model", choices=tuple(MODELS))
    parser.add_argument("--models", default="47M,0.5B", help="step: the shapes to run")
    args = parser.parse_args()
    if args.command == "_child":
        print(json.dumps(child(args.engine, args.model, args.calls)), flush=True)
        return
    started, code = time.time(), revision()
    report = {"speed": speed, "step": step, "demo": demo}[args.command](args)
    command = "python -m benchmarks.vllm_engine " + " ".join(sys.argv[1:])
    render = functools.partial(markdown, args.command)
    save_results(f"vllm_{args.command}", report, render, command, started, code)


if __name__ == "__main__":
    main()
