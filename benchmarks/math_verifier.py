"""honing's math verifier against math-verify used directly, side by side in one run.

Throughput: the same generated (ground truth, response) pairs as the peer script
``shared/peers/mathverify_bench.py`` (its ``gen_pair`` with the same seed, and the same
discarded warm-up batch), scored by (a) math-verify in this process with its default
timeouts, exactly as the peer script does, (b) ``verify_math`` one call at a time with one
slow-path worker ("single"), (c) ``MathVerifier(workers=2).score_batch`` ("pooled").
Agreement with the pairs' expected labels, p50/p99/max latency, repeated ``--repeats`` times;
the medians are reported.

Also: agreement and near-miss false positives of both on the hand-labelled set
(tests/rewards/data/math_labelled.jsonl), and the deadline overshoot of the pool on a runaway
(``9^{9^{9^{9}}}`` vs ``1``). Writes benchmarks/results/math_verifier.{json,md}. Timings
mean something only with the machine otherwise idle:

    flock /tmp/honing-heavy.lock .venv/bin/python benchmarks/math_verifier.py 2000
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PEERS = ROOT.parent / "shared" / "peers"
LABELLED = ROOT / "tests" / "rewards" / "data" / "math_labelled.jsonl"


def load_peer() -> Any:
    if not (PEERS / "mathverify_bench.py").is_file():
        sys.exit(
            f"peer script not found: {PEERS / 'mathverify_bench.py'} (shared/ beside the repo)"
        )
    sys.path.insert(0, str(PEERS))
    return importlib.import_module("mathverify_bench")


def peer_pairs(peer: Any, count: int) -> list[tuple[str, str, bool, str]]:
    """The pairs the peer script times: seed 0, one discarded batch, then ``count`` pairs."""
    peer.random.seed(0)
    [peer.gen_pair() for _ in range(count)]
    return [peer.gen_pair() for _ in range(count)]


def latency_summary(latencies: list[float]) -> dict[str, float]:
    ordered = sorted(latencies)
    pick = lambda q: round(1e3 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)
    return {"p50_ms": pick(0.5), "p99_ms": pick(0.99), "max_ms": round(1e3 * ordered[-1], 3)}


def run_math_verify(pairs: list[tuple[str, str, bool, str]]) -> dict[str, Any]:
    from math_verify import parse, verify

    latencies, agree = [], 0
    started = time.perf_counter()
    for gold, prediction, expected, _ in pairs:
        tick = time.perf_counter()
        said = verify(parse(gold), parse(prediction))
        latencies.append(time.perf_counter() - tick)
        agree += said == expected
    total = time.perf_counter() - started
    return {"per_s": len(pairs) / total, "agree": agree, **latency_summary(latencies)}


def run_single(pairs: list[tuple[str, str, bool, str]]) -> dict[str, Any]:
    from honing.rewards.math.verifier import MathVerifier

    with MathVerifier(workers=1, timeout_s=5.0) as verifier:
        verifier.pool.check([(["$1$"], "$1$")])  # start the worker outside the clock
        latencies, agree, slow = [], 0, 0
        started = time.perf_counter()
        for gold, prediction, expected, _ in pairs:
            tick = time.perf_counter()
            result = verifier(prediction, gold)
            latencies.append(time.perf_counter() - tick)
            agree += (result["score"] == 1.0) == expected
            slow += result["path"] == "slow"
        total = time.perf_counter() - started
    return {
        "per_s": len(pairs) / total,
        "agree": agree,
        "slow_path": slow,
        **latency_summary(latencies),
    }


def run_pooled(pairs: list[tuple[str, str, bool, str]], workers: int) -> dict[str, Any]:
    from honing.rewards.math.verifier import MathVerifier

    items = [{"response": prediction, "ground_truth": gold} for gold, prediction, _, _ in pairs]
    with MathVerifier(workers=workers, timeout_s=5.0) as verifier:
        verifier.pool.check([(["$1$"], "$1$")] * workers)  # start the workers outside the clock
        started = time.perf_counter()
        results = verifier.score_batch(items)
        total = time.perf_counter() - started
    agree = sum((r["score"] == 1.0) == p[2] for r, p in zip(results, pairs, strict=True))
    return {"per_s": len(pairs) / total, "agree": agree}


def run_slow_path_only(pairs: list[tuple[str, str, bool, str]], workers: int) -> dict[str, Any]:
    """math-verify through the pool on every pair: what the slow path alone sustains."""
    from honing.rewards.math.pool import MathPool

    with MathPool(workers=workers, timeout_s=5.0) as pool:
        pool.check([(["$1$"], "$1$")] * workers)
        started = time.perf_counter()
        results = pool.check([([gold], prediction) for gold, prediction, _, _ in pairs])
        total = time.perf_counter() - started
    agree = sum((r["verdict"] == "correct") == p[2] for r, p in zip(results, pairs, strict=True))
    return {"per_s": len(pairs) / total, "agree": agree}


def labelled_set() -> dict[str, Any]:
    """Ours and math-verify (on the whole response, its own extraction) vs the hand labels."""
    from math_verify import parse, verify

    from honing.rewards.math.verifier import MathVerifier

    rows = [json.loads(line) for line in LABELLED.read_text().splitlines()]
    with MathVerifier(workers=2, timeout_s=5.0) as verifier:
        ours = verifier.score_batch(
            [{"response": r["response"], "ground_truth": r["ground_truth"]} for r in rows]
        )
    ours_said = [result["score"] == 1.0 for result in ours]
    theirs_said = []
    for row in rows:
        gold = str(row["ground_truth"])
        gold = gold if "$" in gold or "\\boxed" in gold else f"${gold}$"
        theirs_said.append(bool(verify(parse(gold), parse(row["response"]))))

    def score(said: list[bool]) -> dict[str, Any]:
        agree = sum(s == bool(r["label"]) for s, r in zip(said, rows, strict=True))
        false_pos = sum(s and not r["label"] for s, r in zip(said, rows, strict=True))
        near = sum(s and r["near_miss"] for s, r in zip(said, rows, strict=True))
        return {
            "agreement": f"{agree}/{len(rows)} ({100 * agree / len(rows):.1f}%)",
            "false_positives": false_pos,
            "near_miss_false_positives": near,
            "false_negatives": sum(not s and r["label"] for s, r in zip(said, rows, strict=True)),
        }

    return {"rows": len(rows), "near_miss_rows": sum(r["near_miss"] for r in rows),
            "honing": score(ours_said), "math_verify": score(theirs_said)}  # fmt: skip


def deadline_overshoot(trials: int = 4, timeout_s: float = 1.0) -> dict[str, Any]:
    from honing.rewards.math.pool import MathPool

    with MathPool(workers=2, timeout_s=timeout_s) as pool:
        pool.check([(["$1$"], "$1$")] * 2)
        results = pool.check([(["$1$"], "$9^{9^{9^{9}}}$")] * trials)
    overshoots = [r["elapsed_s"] - timeout_s for r in results]
    return {
        "timeout_s": timeout_s,
        "verdicts": sorted({r["verdict"] for r in results}),
        "overshoot_ms_max": round(1e3 * max(overshoots), 2),
        "overshoot_ms_median": round(1e3 * statistics.median(overshoots), 2),
    }


def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {key: round(statistics.median(run[key] for run in runs), 3) for key in runs[0]}


def write_markdown(report: dict[str, Any]) -> None:
    mv, single, pooled = report["math_verify"], report["honing_single"], report["honing_pooled"]
    slow = report["slow_path_only"]
    n = report["n_pairs"]
    lines = [
        "# Math verifier vs math-verify",
        "",
        f"{n} generated pairs from `shared/peers/mathverify_bench.py` (seed 0), "
        f"median of {report['repeats']} runs, {report['cpus']} CPUs. "
        "Produced by `benchmarks/math_verifier.py`.",
        "",
        "| scorer | verifications/s | × math-verify | agreement | p50 ms | p99 ms | max ms |",
        "|---|---|---|---|---|---|---|",
        f"| math-verify 0.9.0 direct, 1 process | {mv['per_s']:.1f} | 1.0 | "
        f"{mv['agree']:.0f}/{n} | {mv['p50_ms']} | {mv['p99_ms']} | {mv['max_ms']} |",
        f"| honing, 1 process (+1 slow worker) | {single['per_s']:.1f} | "
        f"{single['per_s'] / mv['per_s']:.1f} | {single['agree']:.0f}/{n} | "
        f"{single['p50_ms']} | {single['p99_ms']} | {single['max_ms']} |",
        f"| honing, `score_batch`, 2 workers | {pooled['per_s']:.1f} | "
        f"{pooled['per_s'] / mv['per_s']:.1f} | {pooled['agree']:.0f}/{n} | | | |",
        f"| math-verify in honing's pool only (slow path forced), 2 workers | "
        f"{slow['per_s']:.1f} | {slow['per_s'] / mv['per_s']:.1f} | {slow['agree']:.0f}/{n} "
        "| | | |",
        "",
        f"Slow-path checks (math-verify in a worker) among the pairs: {single['slow_path']:.0f}.",
        "",
        "## Hand-labelled set",
        "",
        f"{report['labelled']['rows']} rows ({report['labelled']['near_miss_rows']} near misses).",
        "",
        "| scorer | agreement | false positives | on near misses | false negatives |",
        "|---|---|---|---|---|",
    ]
    for name in ("honing", "math_verify"):
        row = report["labelled"][name]
        lines.append(
            f"| {name} | {row['agreement']} | {row['false_positives']} | "
            f"{row['near_miss_false_positives']} | {row['false_negatives']} |"
        )
    over = report["deadline"]
    lines += [
        "",
        "## Deadline",
        "",
        f"Runaway `9^{{9^{{9^{{9}}}}}}` vs `1` under a {over['timeout_s']} s deadline: verdicts "
        f"{over['verdicts']}, overshoot median {over['overshoot_ms_median']} ms, "
        f"max {over['overshoot_ms_max']} ms.",
        "",
    ]
    (RESULTS / "math_verifier.md").write_text("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pairs", type=int, nargs="?", default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    peer = load_peer()
    pairs = peer_pairs(peer, args.pairs)
    runs: dict[str, list[dict[str, Any]]] = {
        "math_verify": [],
        "single": [],
        "pooled": [],
        "slow_path_only": [],
    }
    for repeat in range(args.repeats):
        runs["math_verify"].append(run_math_verify(pairs))
        runs["single"].append(run_single(pairs))
        runs["pooled"].append(run_pooled(pairs, workers=2))
        runs["slow_path_only"].append(run_slow_path_only(pairs, workers=2))
        print(
            f"repeat {repeat + 1}: "
            + ", ".join(f"{k} {v[-1]['per_s']:.1f}/s" for k, v in runs.items())
        )
    report = {
        "n_pairs": args.pairs,
        "repeats": args.repeats,
        "cpus": os.cpu_count(),
        "math_verify": median_of(runs["math_verify"]),
        "honing_single": median_of(runs["single"]),
        "honing_pooled": median_of(runs["pooled"]),
        "slow_path_only": median_of(runs["slow_path_only"]),
        "runs": runs,
        "labelled": labelled_set(),
        "deadline": deadline_overshoot(),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "math_verifier.json").write_text(json.dumps(report, indent=1) + "\n")
    write_markdown(report)
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=1))


if __name__ == "__main__":
    main()
