"""Long chains of thought on the trainer: the activation memory of one long sequence with
and without sequence parallelism.

The workload: the grpo_step benchmark's ~47M-parameter Qwen2 shape (hidden 512, 10 layers,
8 heads over 2 KV heads, 32k vocabulary), random weights, one sequence of a 64-token prompt
and a response of fixed token ids filling ``--lengths`` tokens in all. For each length:

- ``sp=N``: Ulysses sequence parallelism over N gloo ranks spawned here, each rank its
  slice, through honing's packed forward (``trainer.sequence_packed``, what the trainer's
  pass runs for this model) and through the model's own forward with the exchanging
  attention (``trainer.sequence_parallel``); ``sp=1`` is each pass in one process, the
  like-for-like reference of the ratios. ``sp=1`` through the packed forward keeps what the
  trainer's own pass without sequence parallelism keeps (``response_logprobs(packed=True)``:
  the same bytes, 503.9 MB at 1,024 tokens).

The figure is what autograd keeps for the backward pass (``trainer.memory.saved_bytes``,
the parameters excluded), per rank: the most of any rank. It is counted, not timed, so the
ranks may share the cores.

    .venv/bin/python -m benchmarks.long_chain [--lengths 2048,4096,8192] [--sp 1,2,4]

Writes benchmarks/results/long_chain.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from benchmarks.moe import cpu_model

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PROMPT = 64
PATHS = {"packed": "honing's packed forward", "model": "the model's own forward"}
SHAPE = {
    "hidden_size": 512,
    "num_hidden_layers": 10,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "intermediate_size": 1536,
    "vocab_size": 32768,
}


def model(length: int):
    """The ~47M Qwen2, random weights (the same on every rank: one seed), fp32, train mode."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        **SHAPE, max_position_embeddings=length + 64, tie_word_embeddings=True, pad_token_id=0
    )
    torch.manual_seed(0)
    built = Qwen2ForCausalLM(config).float().train()
    built.set_attn_implementation("sdpa")
    return built


def batch(length: int):
    """One sequence: a 64-token prompt and ``length - 64`` response tokens, fixed ids."""
    import torch

    from honing.trainer.batch import collate
    from honing.types import Rollout

    ids = torch.Generator().manual_seed(1)
    tokens = torch.randint(1, SHAPE["vocab_size"], (length,), generator=ids).tolist()
    rollout = Rollout(
        prompt_id="long",
        group_index=0,
        prompt_ids=tokens[:PROMPT],
        response_ids=tokens[PROMPT:],
        behaviour_logprobs=[0.0] * (length - PROMPT),
        finish_reason="length",
        weight_version=0,
        text="",
    )
    return collate([rollout], 0, torch.device("cpu"))


def _rank(rank: int, world: int, port: int, length: int, path: str, out: str) -> None:
    import torch.distributed as dist

    from honing.host import exit_now
    from honing.trainer.memory import saved_bytes
    from honing.trainer.ulysses.packed import packed_sequence_parallel_logprobs
    from honing.trainer.ulysses.parallel import (
        SequenceGroup,
        sequence_parallel_logprobs,
        use_ulysses,
    )

    passes = {"packed": packed_sequence_parallel_logprobs, "model": sequence_parallel_logprobs}

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        policy = model(length) if path == "packed" else use_ulysses(model(length), world)
        with saved_bytes(policy.parameters()) as saved:
            passes[path](policy, batch(length), SequenceGroup.of(), with_entropy=True)
        Path(out, f"{rank}.json").write_text(json.dumps(saved.bytes))
    finally:
        dist.destroy_process_group()
    exit_now()  # the figure is on disk: no teardown to abort in (about 1 spawn in 8 did)


def sequence_parallel(length: int, world: int, path: str) -> int:
    """The most saved bytes of any of ``world`` ranks sharing the sequence on ``path``
    (``packed`` or ``model``)."""
    import torch.multiprocessing as mp

    from honing.services.process import free_port

    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_rank, args=(world, free_port(), length, path, out), nprocs=world)
        return max(json.loads(Path(out, f"{r}.json").read_text()) for r in range(world))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="2048,4096,8192")
    parser.add_argument("--sp", default="1,2,4")
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    worlds = [int(x) for x in args.sp.split(",")]
    rows, runs = [], []
    for length in lengths:
        for path in ("packed", "model"):
            per = {w: sequence_parallel(length, w, path) for w in worlds}
            runs.append({"length": length, "path": path, "sp": per})
            base = per.get(1, per[min(per)])
            cells = " | ".join(f"{per[w] / 2**20:,.0f} ({per[w] / base:.2f}×)" for w in worlds)
            rows.append(f"| {length:,} | {PATHS[path]} | {cells} |")
            print(rows[-1], flush=True)
    command = f"python -m benchmarks.long_chain --lengths {args.lengths} --sp {args.sp}"
    head = " | ".join(f"sp={w}: MB per rank" for w in worlds)
    table = [
        f"`{command}` ({cpu_model()}, {os.cpu_count()} cores): bytes autograd keeps for the "
        "backward pass of one sequence's logprob pass, the ~47M Qwen2 (hidden 512, 10 "
        "layers, 32k vocabulary), most of any rank; in brackets against sp=1 (the same pass "
        "in one process)",
        "",
        f"| tokens | pass | {head} |",
        "|---:|---|" + "---:|" * len(worlds),
        *rows,
    ]
    write_results("long_chain", {"command": command, "runs": runs}, table)


def write_results(name: str, record: dict, table: list[str]) -> None:
    """benchmarks/results/``name``.json (``record``) and .md (``table``'s lines), printed."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(record))
    (RESULTS / f"{name}.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))


if __name__ == "__main__":
    main()
