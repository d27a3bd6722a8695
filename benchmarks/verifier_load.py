"""Load test of ``honing serve verifier`` on loopback, and a replica killed mid-run.

Part 1: one service process (``--workers 2``); 1, 8 and 64 concurrent clients each send
``/score`` requests of ``--items`` math items (mixed kinds, a third wrong, every response
unique so nothing is cached), for at most ``--requests`` requests or ``--seconds`` per level.
Reports requests/s, items/s and request latency p50/p99 per level.

Part 2: two service processes behind one ``VerifierClient`` (the trainer's own client); one
is SIGKILLed while a batch is being scored. Reports items scored, items lost (must be 0) and
the client's counters.

Usage: python benchmarks/verifier_load.py [--requests 400] [--seconds 20] [--items 8]
Writes benchmarks/results/verifier_load.{json,md}. Traffic goes to 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from honing.rewards.remote import VerifierClient  # noqa: E402
from honing.services.process import start_service  # noqa: E402


def math_item(rng: random.Random, serial: int) -> dict:
    """A math item whose response is unique (the serial) and right two times in three."""
    kind = rng.choice(["int", "frac", "sqrt", "expr", "interval"])
    wrong = rng.random() < 1 / 3
    if kind == "int":
        truth, answer = str(serial), str(serial + wrong)
    elif kind == "frac":
        truth, answer = f"\\frac{{{serial}}}{{7}}", f"{2 * serial + 2 * wrong}/14"
    elif kind == "sqrt":
        truth, answer = f"{serial}\\sqrt{{2}}", f"\\sqrt{{{2 * serial * serial + wrong}}}"
    elif kind == "expr":
        truth, answer = f"(x+{serial})^2", f"x^2+{2 * serial}x+{serial * serial + wrong}"
    else:
        truth, answer = f"(0, {serial}]", f"(0, {serial + wrong}]"
    response = f"Working it out... so the answer is $\\boxed{{{answer}}}$."
    return {"data_source": "math", "response": response, "ground_truth": truth}


def start_server(workers: int) -> tuple[subprocess.Popen, str]:
    return start_service("verifier", "--workers", str(workers), "--max-queue", "256")


async def _post(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: bytes) -> int:
    """One keep-alive HTTP/1.1 POST /score; returns the status code (body read and dropped)."""
    head = "POST /score HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
    writer.write(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
    await writer.drain()
    status = int((await reader.readline()).split()[1])
    length = 0
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        if name.lower() == "content-length":
            length = int(value)
    await reader.readexactly(length)
    return status


async def load_level(url: str, clients: int, requests: int, seconds: float, items: int) -> dict:
    """``clients`` connections, each sending requests back to back. A minimal asyncio client
    rather than httpx: at 64 connections httpx's pool costs more CPU than the server on these
    2 cores (measured: 88 vs 422 requests/s), and the client shares the machine."""
    host, port = url.rsplit("/", 1)[-1].rsplit(":", 1)
    rng = random.Random(clients)
    serial = iter(range(10**9))
    latencies: list[float] = []
    codes: dict[int, int] = {}
    sent = 0
    deadline = time.perf_counter() + seconds

    async def client() -> None:
        nonlocal sent
        reader, writer = await asyncio.open_connection(host, int(port))
        while sent < requests and time.perf_counter() < deadline:
            sent += 1
            batch = [math_item(rng, next(serial)) for _ in range(items)]
            body = json.dumps({"items": batch}).encode()
            start = time.perf_counter()
            status = await _post(reader, writer, body)
            latencies.append(time.perf_counter() - start)
            codes[status] = codes.get(status, 0) + 1
        writer.close()

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    wall = time.perf_counter() - start
    latencies.sort()
    done = codes.get(200, 0)
    return {
        "clients": clients,
        "requests": len(latencies),
        "status_codes": codes,
        "wall_s": round(wall, 2),
        "requests_per_s": round(done / wall, 1),
        "items_per_s": round(done * items / wall, 1),
        "latency_ms_p50": round(1e3 * latencies[len(latencies) // 2], 1),
        "latency_ms_p99": round(1e3 * latencies[int(0.99 * (len(latencies) - 1))], 1),
    }


def kill_one_replica(items: int = 6000, kill_after_s: float = 0.3) -> dict:
    first, first_url = start_server(1)
    second, second_url = start_server(1)
    try:
        client = VerifierClient([first_url, second_url], request_items=8, max_concurrency=4)
        rng = random.Random(7)
        batch = [math_item(rng, i) for i in range(items)]
        killer = threading.Timer(kill_after_s, first.send_signal, args=(signal.SIGKILL,))
        start = time.perf_counter()
        killer.start()
        results = client.score_batch(batch)
        wall = time.perf_counter() - start
        killer.join()
        killed_during_run = first.poll() is not None and wall > kill_after_s
        lost = sum(not isinstance(r, dict) for r in results)
        counters = {k: int(v) for k, v in client.last_metrics.items()}
        client.close()
        return {
            "items": items,
            "scored": items - lost,
            "lost": lost,
            "kill_after_s": kill_after_s,
            "killed_during_run": killed_during_run,
            "wall_s": round(wall, 2),
            "client_counters": counters,
        }
    finally:
        for process in (first, second):
            process.kill()
            process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=400, help="most requests per level")
    parser.add_argument("--seconds", type=float, default=20.0, help="most seconds per level")
    parser.add_argument("--items", type=int, default=8, help="items per request")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    process, url = start_server(2)
    try:
        asyncio.run(load_level(url, 4, 20, 10, args.items))  # warm the workers up
        levels = [
            asyncio.run(load_level(url, clients, args.requests, args.seconds, args.items))
            for clients in (1, 8, 64)
        ]
    finally:
        process.terminate()
        process.wait()
    failover = kill_one_replica()
    report = {"items_per_request": args.items, "cores": os.cpu_count(), "levels": levels}
    report["failover"] = failover
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "verifier_load.json").write_text(json.dumps(report, indent=1) + "\n")
    lines = [
        f"# Verifier service load test ({os.cpu_count()} cores, loopback, "
        f"{args.items} math items per request, --workers 2)",
        "",
        "| clients | requests | requests/s | items/s | p50 ms | p99 ms | status codes |",
        "|---|---|---|---|---|---|---|",
    ]
    for level in levels:
        lines.append(
            f"| {level['clients']} | {level['requests']} | {level['requests_per_s']} | "
            f"{level['items_per_s']} | {level['latency_ms_p50']} | {level['latency_ms_p99']} | "
            f"{level['status_codes']} |"
        )
    lines += [
        "",
        f"Failover: two replicas, one SIGKILLed {failover['kill_after_s']} s into a "
        f"{failover['items']}-item batch "
        f"(killed during the run: {failover['killed_during_run']}): {failover['scored']} "
        f"scored, {failover['lost']} lost, {failover['wall_s']} s; client counters "
        f"{failover['client_counters']}.",
    ]
    (args.out / "verifier_load.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
