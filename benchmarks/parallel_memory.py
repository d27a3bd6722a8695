"""Memory per rank of expert parallelism and tensor parallelism, from the tensors themselves.

- ``moe``: a Qwen3-MoE model with random weights (32 experts, hidden 256, expert width 256,
  4 layers, top-4 routing, 4096 tokens of vocabulary), at EP=1 (the model unchanged, one
  process), EP=2 and EP=4 (``apply_expert_parallel`` over the gloo ranks: E / ep experts each).
  Every rank holds the same weights and feeds its own batch.
- ``dense``: a Qwen2 model with random weights (hidden 512, 8 heads, 4 key/value heads,
  intermediate 2048, 4 layers) at TP=1 and TP=2 (``tensor_parallel.parallelize`` on a 1-D
  ``tp`` mesh); both ranks of a tensor-parallel group feed the same batch, as they must.

Each rank runs one forward and backward of the causal LM loss on ``--rows`` x ``--tokens``
tokens, then one ``torch.optim.AdamW`` step, and reports the bytes it holds (a DTensor by its
local shard): parameters, gradients, and the Adam moments (``exp_avg`` + ``exp_avg_sq``),
split into expert and dense parts for the MoE model (``ExpertShards.parameter_names``; at EP=1
the same experts modules) and into split and whole parts for the dense one (the projections
its tensor-parallel plan splits, and the rest).

Activation memory: the CPU allocator's allocations and frees during the pass, as
``torch.profiler`` records them with ``profile_memory=True`` (every tensor the pass allocates,
on this rank's threads; not the process's resident memory, which the allocator's caching
blurs). "forward" is what is still allocated when the forward ends (what the backward keeps),
"peak" the most allocated at any point of the forward and backward, both above what was
allocated before the pass; the peak includes the gradients written during the backward.
Python's cycle collector is paused for the pass. Limit: the profiler sees the frees of this
rank's own threads only; a tensor whose last reference gloo's threads drop (an expert-parallel
exchange's buffers) counts as allocated to the end of the pass, so the EP=2 and EP=4 figures
are upper bounds that move by a few MB from run to run.

    .venv/bin/python -m benchmarks.parallel_memory [--rows 4] [--tokens 128]

Writes benchmarks/results/parallel_memory.{json,md}.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks.grpo_step import revision, save_results

MB = 1e6
VOCAB = 4096
MOE = {
    "hidden_size": 256,
    "moe_intermediate_size": 256,
    "intermediate_size": 512,
    "num_experts": 32,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": VOCAB,
    "tie_word_embeddings": False,
}
DENSE = {
    "hidden_size": 512,
    "intermediate_size": 2048,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "vocab_size": VOCAB,
    "tie_word_embeddings": False,
}
RUNS = (("moe", 1), ("moe", 2), ("moe", 4), ("dense", 1), ("dense", 2))
LABEL = {"moe": "EP", "dense": "TP"}
TOLERANCE = 0.10  # the 1/N target, relative


def build(kind: str) -> torch.nn.Module:
    """The benchmark's model, the same random weights in every process."""
    from transformers import AutoConfig, AutoModelForCausalLM

    family, options = ("qwen3_moe", MOE) if kind == "moe" else ("qwen2", DENSE)
    torch.manual_seed(0)
    config = AutoConfig.for_model(family, **options)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).train()


def local_bytes(tensor: torch.Tensor | None) -> int:
    if tensor is None:
        return 0
    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    return tensor.numel() * tensor.element_size()


def moe_parts(model: torch.nn.Module, size: int) -> tuple[set[str], dict]:
    """The expert parameters' names, after sharding them over ``size`` ranks (none at 1), and
    ``take_metrics`` of the shards after a pass (a callable; nothing at 1)."""
    from honing.models.moe import routers_of
    from honing.trainer.expert_parallel import apply_expert_parallel

    if size == 1:
        modules = {id(block.experts) for block in routers_of(model).blocks}
        names = {
            f"{path}.{name}"
            for path, module in model.named_modules()
            if id(module) in modules
            for name, _ in module.named_parameters(recurse=False)
        }
        return names, dict
    shards = apply_expert_parallel(model, dist.group.WORLD)
    return set(shards.parameter_names), shards.take_metrics


def dense_parts(model: torch.nn.Module, size: int) -> set[str]:
    """The names of the parameters the tensor-parallel plan splits (found by the plan for 2
    ranks at TP=1), after splitting the model over ``size`` ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    from honing.trainer.tensor_parallel import layer_plans, parallelize

    layers = {id(layer): index for index, layer in enumerate(model.model.layers)}
    names = set()
    for layer, plan in layer_plans(model, 2):
        for path in plan:
            for name, _ in layer.get_submodule(path).named_parameters():
                names.add(f"model.layers.{layers[id(layer)]}.{path}.{name}")
    if size > 1:
        parallelize(model, init_device_mesh("cpu", (size,), mesh_dim_names=("tp",)))
    return names


def _walk(nodes):
    for node in nodes:
        yield node
        yield from _walk(node.children)


def activation_bytes(prof) -> tuple[int, int]:
    """(allocated when the ``forward`` range ends, peak allocated) over the profiled pass,
    above what was allocated at its start: the allocator's events summed in time order."""
    from torch._C._profiler import _EventType

    nodes = list(_walk(prof.profiler.kineto_results.experimental_event_tree()))
    forward_end = max(n.end_time_ns for n in nodes if n.name == "forward")
    allocations = sorted(
        (n for n in nodes if n.tag == _EventType.Allocation), key=lambda n: n.start_time_ns
    )
    live = peak = at_forward = 0
    for node in allocations:
        live += node.extra_fields.alloc_size
        peak = max(peak, live)
        if node.start_time_ns <= forward_end:
            at_forward = live
    return at_forward, peak


def measure(kind: str, size: int, rows: int, tokens: int) -> dict:
    """One rank's bytes: state by part after a pass and an AdamW step, and the pass's
    activations."""
    torch.set_num_threads(1)
    rank = dist.get_rank()
    model = build(kind)
    if kind == "moe":
        named, metrics = moe_parts(model, size)
        parts = ("expert", "dense")
    else:
        named, metrics = dense_parts(model, size), dict
        parts = ("split", "whole")
    seed = 1 + (rank if kind == "moe" else 0)  # a tensor-parallel group shares its batch
    ids = torch.randint(0, VOCAB, (rows, tokens), generator=torch.Generator().manual_seed(seed))
    gc.collect()
    gc.disable()  # a tensor held in a reference cycle lives to the end of the pass
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function("forward"):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    gc.enable()
    forward, peak = activation_bytes(prof)
    imbalance = metrics()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    optimizer.step()
    result = {f"{part}_{what}": 0 for part in parts for what in ("params", "grads", "adam")}
    for name, param in model.named_parameters():
        part = parts[0] if name in named else parts[1]
        state = optimizer.state[param]
        result[f"{part}_params"] += local_bytes(param)
        result[f"{part}_grads"] += local_bytes(param.grad)
        result[f"{part}_adam"] += local_bytes(state["exp_avg"]) + local_bytes(state["exp_avg_sq"])
    return result | {
        "rank": rank,
        "activations_forward": forward,
        "activations_peak": peak,
        "loss": loss.item(),
        "metrics": {k: v for k, v in imbalance.items() if "imbalance" in k},
    }


def _rank(rank: int, port: int, world: int, out: str, args: tuple) -> None:
    from honing.host import exit_now

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        result = measure(*args)
        Path(f"{out}.{rank}").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()
    exit_now()  # gloo's threads may abort in the interpreter's teardown


def run(kind: str, size: int, rows: int, tokens: int) -> list[dict]:
    """Every rank's ``measure`` for ``size`` gloo ranks, in rank order."""
    from honing.services.process import free_port

    with tempfile.TemporaryDirectory() as work:
        out = f"{work}/rank"
        args = (free_port(), size, out, (kind, size, rows, tokens))
        mp.spawn(_rank, args=args, nprocs=size)
        return [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(size)]


def state(rank: dict, part: str) -> int:
    return sum(rank[f"{part}_{what}"] for what in ("params", "grads", "adam"))


def checks(runs: dict[str, list[dict]]) -> list[dict]:
    """Each sharded part's state per rank against 1/N of one process's, rank by rank."""
    found = []
    for key, ranks in runs.items():
        label, size = key.split("=")
        size = int(size)
        if size == 1:
            continue
        part = "expert" if label == "EP" else "split"
        whole = state(runs[f"{label}=1"][0], part)
        for rank in ranks:
            ratio = state(rank, part) / whole
            found.append(
                {
                    "run": key,
                    "rank": rank["rank"],
                    "part": part,
                    "ratio": ratio,
                    "target": 1 / size,
                    "holds": abs(ratio * size - 1) <= TOLERANCE,
                }
            )
    return found


def _mb(value: float) -> str:
    return f"{value / MB:.1f}"


def markdown(report: dict) -> str:
    lines = [
        "# Memory per rank of expert and tensor parallelism",
        "",
        f"Machine: {report['machine']}; revision {report['revision']}; "
        f"`{report['command']}` ({report['wall_s']:.0f} s).",
        "",
        __doc__.split("\n\n    .venv")[0].split("\n\n", 1)[1],
        "",
        f"Batch per rank: {report['rows']} rows x {report['tokens']} tokens; float32. "
        "MB = 10^6 bytes. State columns are per rank (the same on every rank of a run); "
        "activations are the largest over the ranks.",
        "",
        "| run | rank-local part | params MB | grads MB | Adam MB | state MB "
        "| other part: state MB | all state MB | activations forward MB "
        "| activations peak MB | load imbalance max / mean |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for key, ranks in report["runs"].items():
        first = ranks[0]
        part, other = ("expert", "dense") if key.startswith("EP") else ("split", "whole")
        metrics = first["metrics"]
        imbalance = (
            f"{metrics['ep/load_imbalance/max']:.3f} / {metrics['ep/load_imbalance/mean']:.3f}"
            if metrics
            else "-"
        )
        lines.append(
            f"| {key} | {part} | {_mb(first[f'{part}_params'])} | {_mb(first[f'{part}_grads'])} "
            f"| {_mb(first[f'{part}_adam'])} | {_mb(state(first, part))} "
            f"| {other}: {_mb(state(first, other))} "
            f"| {_mb(state(first, part) + state(first, other))} "
            f"| {_mb(max(r['activations_forward'] for r in ranks))} "
            f"| {_mb(max(r['activations_peak'] for r in ranks))} | {imbalance} |"
        )
    lines += ["", "Sharded state per rank against 1/N of one process's (target within 10%):", ""]
    lines += ["| run | rank | part | state / one process's | 1/N | holds |"]
    lines += ["|---|---:|---|---:|---:|---|"]
    for check in report["checks"]:
        lines.append(
            f"| {check['run']} | {check['rank']} | {check['part']} | {check['ratio']:.4f} "
            f"| {check['target']:.4f} | {'yes' if check['holds'] else 'no'} |"
        )
    lines += ["", summary(report)]
    return "\n".join(lines) + "\n"


def summary(report: dict) -> str:
    """The target's verdict, and what stays whole on every rank."""
    runs, verdicts = report["runs"], report["checks"]
    held = all(check["holds"] for check in verdicts)
    worst = max(abs(check["ratio"] * check["target"] ** -1 - 1) for check in verdicts)
    return (
        f"The 1/N target {'holds' if held else 'does not hold'} on every rank "
        f"(largest gap {worst:.1%}). The MoE model's dense part (embeddings, LM head, "
        f"attention, norms, routers) is replicated: {_mb(state(runs['EP=1'][0], 'dense'))} MB "
        "of state on every rank at any EP; the Qwen2 model's whole part (embeddings, LM head, "
        f"norms) {_mb(state(runs['TP=1'][0], 'whole'))} MB at any TP. Load imbalance: the most "
        "rows a rank's experts received over the mean over ranks, per MoE layer (max and mean "
        "over the layers) for the one pass."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=4, help="rows per rank")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per row")
    args = parser.parse_args()
    started, code = time.time(), revision()
    runs = {}
    for kind, size in RUNS:
        key = f"{LABEL[kind]}={size}"
        runs[key] = run(kind, size, args.rows, args.tokens)
        print(f"{key}: done", flush=True)
    command = "python -m benchmarks.parallel_memory"
    command += f" --rows {args.rows}" if args.rows != 4 else ""
    command += f" --tokens {args.tokens}" if args.tokens != 128 else ""
    report = {"rows": args.rows, "tokens": args.tokens, "runs": runs, "checks": checks(runs)}
    save_results("parallel_memory", report, markdown, command, started, code)


if __name__ == "__main__":
    main()
