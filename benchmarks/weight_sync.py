"""Weight syncs against the machine's memory bandwidth: seconds per GB and extra resident
memory, in process and to servers.

For the ~40M and ~0.5B Qwen2 shapes of benchmarks/vllm_engine.py (fp32, tied embeddings),
the policy's weights go as the trainer sends them (``TrainedModule.weights``: its state in
buckets of ``rollout.weight_bucket_mb``, a tied tensor once) to:

- ``vllm``: vLLM in this process (``rollout.engine=vllm``): each bucket's live tensors, no
  copy on the trainer's side, through vLLM's layerwise reload;
- ``vllm_server``: a vLLM server with honing's transfer backend (``rollout.weight_sync=vllm``):
  each bucket a safetensors file in /dev/shm, read by the server's worker;
- ``honing_server``: ``honing serve rollout`` (``rollout.weight_sync=tensors``): each bucket
  a safetensors body over loopback HTTP;
- ``honing_server_shm``: the same server with ``rollout.weight_sync=disk`` and
  ``rollout.weight_dir`` in /dev/shm: the shards written to memory, their directory posted.

Each target runs in a process of its own: one sync to warm up, then ``--syncs`` timed ones,
their median. Resident memory is sampled every 2 ms, in this process and in the server's
processes; "extra" is the peak above the level before the sync. Beside them, ``memcpy``: what
one ``Tensor.copy_`` of 256 MB reaches on this machine with the trainer's two threads (the
floor for a sync is one copy of the model's bytes).

    .venv/bin/python -m benchmarks.weight_sync [--models 40M,0.5B] [--buckets 256,64]

(the servers take the first bucket size only).

Writes benchmarks/results/weight_sync.{json,md}. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from benchmarks.grpo_step import SEED, WORK, revision, save_results
from benchmarks.grpo_workloads import build_model_dir
from benchmarks.vllm_engine import MODELS

ROOT = Path(__file__).resolve().parent.parent
TARGETS = ("vllm", "vllm_server", "honing_server", "honing_server_shm")
THREADS = 2
SHM_DIR = "/dev/shm/honing-weight-sync"
QUIET = {"VLLM_LOGGING_LEVEL": "ERROR", "TOKENIZERS_PARALLELISM": "false"}


def memcpy_gb_s(megabytes: int = 256, repeats: int = 7) -> float:
    """GB/s of ``dst.copy_(src)`` for ``megabytes`` of fp32 (bytes read once, written once:
    the bytes of one copy over its time), the median of ``repeats``."""
    import torch

    torch.set_num_threads(THREADS)
    source = torch.randn(megabytes << 18)
    target = torch.empty_like(source)
    target.copy_(source)
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        target.copy_(source)
        times.append(time.perf_counter() - began)
    return source.numel() * 4 / statistics.median(times) / 1e9


class Resident:
    """Peak resident memory (MB) of some processes, sampled every 2 ms while it runs."""

    def __init__(self, pids) -> None:
        import psutil

        self.processes = [psutil.Process(pid) for pid in pids]
        self.peak, self._done = 0.0, threading.Event()
        self.base = self.now()

    def now(self) -> float:
        total = 0
        for process in self.processes:
            for each in [process, *process.children(recursive=True)]:
                with contextlib.suppress(Exception):  # a process that ended meanwhile
                    total += each.memory_info().rss
        return total / 2**20

    def __enter__(self):
        self.base, self.peak = self.now(), 0.0
        self._done.clear()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, self.now())
            time.sleep(0.002)

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()

    @property
    def extra(self) -> float:
        return max(0.0, self.peak - self.base)


def _vllm_server(model_dir: Path, log: Path):
    """A vLLM server with honing's transfer backend on a loopback port (as the tests run
    it), in a process group of its own."""
    from honing.services.process import free_port, wait_healthy

    url = f"http://127.0.0.1:{free_port()}"
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
    argv += ["--host", "127.0.0.1", "--port", url.rsplit(":", 1)[1], "--dtype", "float32"]
    argv += ["--enforce-eager", "--max-model-len", "128", "--kv-cache-memory-bytes", str(64 << 20)]
    argv += ["--logprobs-mode", "processed_logprobs"]
    argv += ["--weight-transfer-config", '{"backend": "honing"}']
    env = os.environ | {"VLLM_SERVER_DEV_MODE": "1", "VLLM_LOGGING_LEVEL": "ERROR"}
    with log.open("ab") as sink:
        process = subprocess.Popen(
            argv, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
    wait_healthy(process, url, 600, "vLLM", lambda: log.read_text()[-3000:])
    return process, url


def child(target: str, model_name: str, bucket_mb: int, syncs: int) -> dict:
    """In a process of its own: ``syncs`` timed weight syncs of ``model_name`` to ``target``."""
    import signal

    import torch

    from honing.models.loading import load_causal_lm, load_tokenizer
    from honing.trainer.engine import TrainedModule

    torch.set_num_threads(THREADS)
    spec, _ = MODELS[model_name]
    model_dir = WORK / "models" / spec.name
    tokenizer = load_tokenizer(model_dir)
    model = load_causal_lm(model_dir, tokenizer, dtype="float32", device=torch.device("cpu"))
    trainer = TrainedModule(
        "policy", model, torch.optim.SGD(model.parameters(), lr=0.0), bucket_bytes=bucket_mb << 20
    )
    sizes = [sum(t.numel() * t.element_size() for _, t in bucket) for bucket in trainer.weights()]
    sent, count = sum(sizes), len(sizes)
    servers: list = []
    try:
        engine = _engine(target, model_name, model_dir, tokenizer, trainer, servers)
        pids = [os.getpid(), *(server.pid for server in servers)]
        seconds, extra_here, extra_server = [], [], []
        engine.load_weights(1, trainer.weights())  # warm-up
        for version in range(2, syncs + 2):
            here = Resident(pids[:1])
            there = Resident(pids[1:]) if servers else None
            with here, there or contextlib.nullcontext():
                began = time.perf_counter()
                engine.load_weights(version, trainer.weights())
                seconds.append(time.perf_counter() - began)
            extra_here.append(here.extra)
            extra_server.append(there.extra if there else 0.0)
        engine.close()
    finally:
        shutil.rmtree(SHM_DIR, ignore_errors=True)  # disk keeps the newest version's shards
        for server in servers:
            if target == "vllm_server":
                os.killpg(server.pid, signal.SIGKILL)
            else:
                server.kill()
            server.wait()
    return {
        "sync_s": statistics.median(seconds),
        "sent_mb": sent / 2**20,
        "buckets": count,
        "extra_mb": statistics.median(extra_here),
        "server_extra_mb": statistics.median(extra_server),
    }


def _engine(target: str, model_name: str, model_dir: Path, tokenizer, trainer, servers: list):
    """The engine that takes the weights of ``target``; a server it starts is put in
    ``servers`` as soon as it runs."""
    if target == "vllm":
        from honing.rollout.vllm.engine import VLLMEngine, VLLMSettings

        return VLLMEngine(
            model_dir,
            tokenizer,
            stop_ids=set(),
            max_seq_len=128,
            settings=VLLMSettings(kv_cache_mb=64, max_num_seqs=16),
            weights=trainer.weights(),
            vocab_size=trainer.module.get_input_embeddings().weight.shape[0],
        )
    from honing.rollout.remote.engine import OpenAIEngine
    from honing.services.process import start_service

    log = WORK / "runs" / "weight_sync" / f"{target}_{model_name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    if target == "vllm_server":  # served as the trainer holds it (honing adds a pad token)
        served = model_dir.with_name(model_dir.name + "_served")
        if not (served / "config.json").exists():
            trainer.module.save_pretrained(served)
            tokenizer.save_pretrained(served)
        server, url = _vllm_server(served, log)
        model_dir = served
    else:
        server, url = start_service("rollout", "--model", str(model_dir), timeout_s=600)
    servers.append(server)
    sync = {"vllm_server": "vllm", "honing_server": "tensors"}.get(target, "disk")
    shm = SHM_DIR if sync == "disk" else ""
    return OpenAIEngine(
        [url], tokenizer, weight_sync=sync, weight_dir=shm, model_dir=str(model_dir)
    )


def run(args) -> dict:
    models = args.models.split(",")
    buckets = [int(b) for b in args.buckets.split(",")]
    for name in models:
        build_model_dir(MODELS[name][0], WORK / "models" / MODELS[name][0].name, SEED)
    report: dict = {"memcpy_gb_s": memcpy_gb_s(), "runs": {}}
    print(f"memcpy: {report['memcpy_gb_s']:.1f} GB/s", flush=True)
    for name in models:
        for target in TARGETS:
            for bucket in buckets if target == "vllm" else buckets[:1]:
                command = [sys.executable, "-m", "benchmarks.weight_sync", "_child", target]
                command += ["--model", name, "--bucket-mb", str(bucket), "--syncs", str(args.syncs)]
                env = os.environ | {
                    "VLLM_LOGGING_LEVEL": "ERROR",
                    "TOKENIZERS_PARALLELISM": "false",
                }
                out = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
                if out.returncode != 0:
                    raise RuntimeError(f"{name} {target} failed:\n{out.stderr[-3000:]}")
                result = json.loads(out.stdout.strip().splitlines()[-1])
                report["runs"][f"{name}/{target}/{bucket}"] = result
                print(f"{name} {target} {bucket} MB: {result}", flush=True)
    return report


def markdown(report: dict) -> str:
    memcpy = report["memcpy_gb_s"]
    lines = [
        "# Weight syncs against memory bandwidth",
        "",
        f"Machine: {report['machine']}; revision {report['revision']}; "
        f"`{report['command']}` ({report['wall_s']:.0f} s).",
        "",
        __doc__.split("\n\n")[1].replace("\n", " "),
        "",
        f"memcpy (one `Tensor.copy_` of 256 MB, {THREADS} threads): **{memcpy:.1f} GB/s**, "
        f"{1 / memcpy:.3f} s per GB. A sync at that rate would cost one copy of the bytes sent.",
        "",
        "| model | target | bucket MB | buckets | sent MB | sync s | s per GB | × memcpy | "
        "extra MB here | extra MB in the server |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for key, r in report["runs"].items():
        model, target, bucket = key.split("/")
        per_gb = r["sync_s"] / (r["sent_mb"] * 2**20 / 1e9)
        lines.append(
            f"| {model} | {target} | {bucket} | {r['buckets']} | {r['sent_mb']:.0f} | "
            f"{r['sync_s']:.3f} | {per_gb:.3f} | {per_gb * memcpy:.1f} | {r['extra_mb']:.0f} | "
            f"{r['server_extra_mb']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("command", nargs="?", default="run", choices=("run", "_child"))
    parser.add_argument("target", nargs="?", choices=TARGETS)
    parser.add_argument("--models", default="40M,0.5B")
    parser.add_argument("--buckets", default="256,64")
    parser.add_argument("--model", choices=tuple(MODELS))
    parser.add_argument("--bucket-mb", type=int, default=256)
    parser.add_argument("--syncs", type=int, default=3)
    args = parser.parse_args()
    if args.command == "_child":
        print(json.dumps(child(args.target, args.model, args.bucket_mb, args.syncs)), flush=True)
        return
    started, code = time.time(), revision()
    command = "python -m benchmarks.weight_sync " + " ".join(sys.argv[1:])
    save_results("weight_sync", run(args), markdown, command, started, code)


if __name__ == "__main__":
    main()
