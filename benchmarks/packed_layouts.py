"""The packed forward's two attention layouts, side by side on GRPO-shaped batches.

Rows of a group share their prompt, which the packed stream runs once either way. The
attention step then takes one of two layouts (``honing.trainer.packed``):

- ``shared``: a block per distinct prompt and one per row's response, every block padded to
  the longest prompt or response, under a mask of what each query sees;
- ``causal``: a block per row, its prompt then its response, under plain causal attention
  (no mask); a group's rows run their prompt's queries again in attention.

``packed_layout`` takes ``causal`` where it scores no more query-key pairs. Each workload
runs one logprob pass (with entropy) forward and backward on the ~47M Qwen2 of the
long_chain benchmark (hidden 512, 10 layers, 8 heads over 2 KV heads, 32k vocabulary),
random weights and token ids, fp32, both layouts alternating for ``--rounds`` rounds:
medians of the time, the bytes autograd keeps for the backward pass (parameters excluded),
and the largest difference of the logprobs between the layouts.

    .venv/bin/python -m benchmarks.packed_layouts [--rounds 3]

Writes benchmarks/results/packed_layouts.{json,md}.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from benchmarks.long_chain import SHAPE, model, write_results
from benchmarks.moe import cpu_model

# name: (prompts, rows per prompt, prompt tokens, response lengths dealt round the rows)
WORKLOADS = {
    "8 x 8, 100-token prompts, 16-128-token answers": (8, 8, 100, [16, 32, 64, 128]),
    "2 x 8, 1,024-token prompts, 32-64-token answers": (2, 8, 1024, [32, 64]),
    "2 x 4, 256-token prompts, 128-1,536-token answers": (2, 4, 256, [128, 512, 1024, 1536]),
    "1 x 4, 128-token prompt, 2,048-token answers": (1, 4, 128, [2048]),
}


def grpo_batch(prompts: int, group: int, prompt: int, lengths: list[int]):
    """``prompts`` x ``group`` rollouts of random ids; row k's response has
    ``lengths[k % len(lengths)]`` tokens."""
    import torch

    from honing.trainer.batch import collate
    from honing.types import Rollout

    ids = torch.Generator().manual_seed(1)
    rollouts = []
    for p in range(prompts):
        prompt_ids = torch.randint(1, SHAPE["vocab_size"], (prompt,), generator=ids).tolist()
        for member in range(group):
            length = lengths[(p * group + member) % len(lengths)]
            response = torch.randint(1, SHAPE["vocab_size"], (length,), generator=ids).tolist()
            rollouts.append(
                Rollout(f"p{p}", member, prompt_ids, response, [0.0] * length, "length", 0, "")
            )
    return collate(rollouts, 0, torch.device("cpu"))


def one_pass(policy, batch, causal: bool):
    """Seconds, saved bytes and logprobs of one forward + backward under the layout."""
    from honing.trainer.memory import saved_bytes
    from honing.trainer.packed import packed_layout, packed_response_logprobs

    weight = policy.model.embed_tokens.weight
    batch.layouts.clear()
    batch.layouts[weight.device, weight.dtype] = packed_layout(
        batch, weight.device, weight.dtype, causal=causal
    )
    with saved_bytes(policy.parameters()) as saved:
        start = time.perf_counter()
        logprobs, entropy = packed_response_logprobs(policy, batch, with_entropy=True)
        (logprobs.sum() + entropy.sum()).backward()
        seconds = time.perf_counter() - start
    policy.zero_grad(set_to_none=True)
    return seconds, saved.bytes, logprobs.detach()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    import torch

    from honing.trainer.packed import packed_layout

    policy = model(max(p + max(r) for _, _, p, r in WORKLOADS.values()))
    rows, runs = [], []
    for name, spec in WORKLOADS.items():
        batch = grpo_batch(*spec)
        seconds, saved, logprobs = {True: [], False: []}, {}, {}
        for round_ in range(args.rounds):
            order = (False, True) if round_ % 2 == 0 else (True, False)
            for causal in order:
                took, saved[causal], logprobs[causal] = one_pass(policy, batch, causal)
                seconds[causal].append(took)
        chosen = packed_layout(batch, torch.device("cpu"), torch.float32).causal
        chosen = "causal" if chosen else "shared"
        shared, causal = statistics.median(seconds[False]), statistics.median(seconds[True])
        differs = (logprobs[True] - logprobs[False]).abs().max().item()
        runs.append(
            {
                "workload": name,
                "seconds": {"shared": seconds[False], "causal": seconds[True]},
                "saved_bytes": {"shared": saved[False], "causal": saved[True]},
                "chosen": chosen,
                "max_logprob_difference": differs,
            }
        )
        rows.append(
            f"| {name} | {shared:.2f} | {saved[False] / 2**20:,.0f} | {causal:.2f} "
            f"({causal / shared:.2f}×) | {saved[True] / 2**20:,.0f} "
            f"({saved[True] / saved[False]:.2f}×) | {chosen} | {differs:.1e} |"
        )
        print(rows[-1], flush=True)
    command = f"python -m benchmarks.packed_layouts --rounds {args.rounds}"
    table = [
        f"`{command}` ({cpu_model()}, {os.cpu_count()} cores): one logprob pass with entropy, "
        "forward and backward, the ~47M Qwen2, fp32; medians of the alternating rounds; "
        "MB kept for the backward pass",
        "",
        "| workload | shared s | shared MB | causal s | causal MB | chosen | logprobs differ |",
        "|---|---:|---:|---:|---:|---|---:|",
        *rows,
    ]
    write_results("packed_layouts", {"command": command, "runs": runs}, table)


if __name__ == "__main__":
    main()
