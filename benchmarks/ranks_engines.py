"""Two torchrun ranks with the policy sharded (FSDP): which rollout engine makes the step
cheapest on a CPU?

The grpo_step benchmark's 10M-parameter model at 128 new tokens (8 prompts x 8 completions,
no reference model), on ``torchrun --nproc_per_node 2`` with one thread a rank, three ways,
alternating, ``--rounds`` times:
- ``vllm_ranks``: vLLM in each rank (``rollout.engine=vllm``), each sampling half the tasks
  and taking the weights from the FSDP gather after every update;
- ``honing_spread``: honing's engine in each rank on its whole copy of the policy, each
  sampling half the tasks (``pipeline.rollout_chunk=4``);
- ``async_server``: ``schedule.mode=async`` through a vLLM server on loopback
  (``rollout.engine=openai``, weights through its RL API, ``rollout.weight_sync=vllm``): rank
  0's producer thread samples from the server while both ranks train; the server is a third
  process on the same two cores.

Per run: medians over the steps after the first of ``timing_s/step`` and of the generated
tokens per second of step time (the batch's response tokens / ``timing_s/step``). Reported:
the medians over rounds.

    .venv/bin/python -m benchmarks.ranks_engines [--rounds 2] [--steps 5]

writes benchmarks/results/ranks_engines.{json,md}. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from benchmarks.grpo_step import M10, RESULTS, SEED, WORK, Workload, honing_overrides, revision
from benchmarks.grpo_workloads import alternating, build_model_dir, peer_data
from honing.services.process import free_port

WORKLOAD = Workload("m10_t128", M10, 128, 0.0, 1, 1)
KV_CACHE_MB = 64
COMMON = [
    "trainer.strategy=fsdp",
    "pipeline.rollout_chunk=4",
    f"rollout.vllm_kv_cache_mb={KV_CACHE_MB}",
]
VARIANTS = {
    "vllm_ranks": ["rollout.engine=vllm"],
    "honing_spread": ["rollout.engine=transformers"],
    "async_server": [
        "rollout.engine=openai",
        "rollout.weight_sync=vllm",
        "schedule.mode=async",
        "schedule.max_staleness=1",
    ],
}


class Server:
    """A vLLM server for the model on a loopback port, in a process group of its own."""

    def __init__(self, model_dir: Path, log: Path):
        self.url = f"http://127.0.0.1:{free_port()}"
        argv = [
            *(sys.executable, "-m", "vllm.entrypoints.openai.api_server"),
            *("--model", str(model_dir), "--host", "127.0.0.1"),
            *("--port", self.url.rsplit(":", 1)[1], "--dtype", "float32", "--enforce-eager"),
            *("--max-model-len", str(WORKLOAD.max_new_tokens + 64)),
            *("--kv-cache-memory-bytes", str(KV_CACHE_MB << 20)),
            *("--logprobs-mode", "processed_logprobs"),
            *("--weight-transfer-config", '{"backend": "honing"}'),
        ]
        env = os.environ | {"VLLM_SERVER_DEV_MODE": "1"}
        with log.open("w") as sink:
            self.process = subprocess.Popen(
                argv, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vLLM exited: {log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.5)
        raise RuntimeError(f"vLLM did not answer: {log.read_text()[-3000:]}")

    def stop(self) -> None:
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


def served_model(directory: Path) -> Path:
    """The model as the trainer holds it: its tokenizer has no pad token, so honing adds one
    and grows the embeddings by a row; a server must serve that vocabulary to take the
    trainer's weights, so every variant starts from this copy."""
    from honing.models.loading import load_causal_lm, load_tokenizer, save_model

    build_model_dir(M10, directory, SEED)
    padded = directory.with_name(directory.name + "_padded")
    if not (padded / "config.json").exists():
        tokenizer = load_tokenizer(directory)
        model = load_causal_lm(directory, tokenizer, dtype="float32", device="cpu")
        save_model(model, tokenizer, padded)
    return padded


def run(name: str, steps: int, model_dir: Path, data: dict, out: Path) -> dict:
    """One run of variant ``name`` (a server started for it and stopped after): its medians
    over the steps after the first."""
    work = Workload(WORKLOAD.name, M10, WORKLOAD.max_new_tokens, 0.0, steps, 1)
    subprocess.run(["rm", "-rf", str(out)], check=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    extra = [*COMMON, *VARIANTS[name]]
    server = Server(model_dir, out.with_suffix(".server.log")) if name == "async_server" else None
    if server is not None:
        extra.append(f"rollout.endpoints={server.url}")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc_per_node", "2", "-m", "honing.cli", "train"]
    command += [*honing_overrides(work, model_dir, data, 1), *extra]
    command += ["--output-dir", str(out), "--resume", "never"]
    try:
        with out.with_suffix(".log").open("w") as sink:
            subprocess.run(command, stdout=sink, stderr=subprocess.STDOUT, check=True)
    finally:
        if server is not None:
            server.stop()
    lines = (out / "metrics.jsonl").read_text().splitlines()
    metrics = [m for m in map(json.loads, lines) if m.get("step", 0) >= 2 and "timing_s/step" in m]
    tokens = [m["response_length/mean"] * m["samples/generated"] for m in metrics]
    return {
        "step_s": statistics.median(m["timing_s/step"] for m in metrics),
        "tokens_per_s": statistics.median(
            t / m["timing_s/step"] for t, m in zip(tokens, metrics, strict=True)
        ),
        "gap_max": max(m.get("rollout_mismatch/logprob_diff_max", 0.0) for m in metrics),
        "generation_ranks": metrics[0].get("rollout/generation_ranks", 1.0),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    model_dir = served_model(WORK / "models" / M10.name)
    data = peer_data(WORK, SEED)
    code, started = revision(), time.time()
    runs: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    for round_index, name in alternating(args.rounds, VARIANTS):
        out = WORK / "runs" / "ranks_engines" / f"{round_index}_{name}"
        runs[name].append(run(name, args.steps, model_dir, data, out))
        got = runs[name][-1]
        print(
            f"round {round_index} {name:13s}: step {got['step_s']:.3f} s, "
            f"{got['tokens_per_s']:.0f} tokens/s",
            flush=True,
        )
    keys = ("step_s", "tokens_per_s")
    medians = {
        name: {k: statistics.median(r[k] for r in results) for k in keys}
        for name, results in runs.items()
    }
    report = {
        "revision": code,
        "command": "python -m benchmarks.ranks_engines " + " ".join(argv or sys.argv[1:]),
        "wall_s": round(time.time() - started, 1),
        "workload": "10M-parameter Qwen2, 8 prompts x 8 completions, 128 new tokens, no KL; "
        "2 torchrun ranks (gloo), 1 thread each, trainer.strategy=fsdp",
        "runs": runs,
        "medians": medians,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "ranks_engines.json").write_text(json.dumps(report, indent=1))
    (RESULTS / "ranks_engines.md").write_text(markdown(report))
    print(markdown(report))


def markdown(report: dict) -> str:
    medians, base = report["medians"], report["medians"]["honing_spread"]
    rows = [
        f"| {name} | {m['step_s']:.2f} | {base['step_s'] / m['step_s']:.2f}x | "
        f"{m['tokens_per_s']:.0f} | {max(r['gap_max'] for r in report['runs'][name]):.2g} |"
        for name, m in medians.items()
    ]
    return "\n".join(
        [
            "# Rollout engines on two sharded ranks",
            "",
            f"{report['workload']}; 2-core CPU; revision {report['revision']}; "
            f"`{report['command'].strip()}` ({report['wall_s']} s). Medians over rounds of "
            "each run's median (first step left out); speed-up of the step against "
            "`honing_spread`; tokens/s: the batch's response tokens over the step's time; "
            "gap: the largest rollout/trainer logprob gap of any step (async: stale by "
            "design).",
            "",
            "| variant | step s | step speed-up | generated tokens/s | gap |",
            "|---|---|---|---|---|",
            *rows,
            "",
            "`vllm_ranks`: vLLM in each rank, half the tasks each. `honing_spread`: honing's "
            "engine in each rank, half the tasks each. `async_server`: async through a vLLM "
            "server on loopback (a third process on the two cores), max_staleness 1.",
            "",
        ]
    )


if __name__ == "__main__":
    main()
