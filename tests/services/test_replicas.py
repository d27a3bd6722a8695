"""Two ``honing serve verifier`` processes behind one client: killing one mid-run loses no
score, the client moves to the other."""

import signal
import threading

import pytest

from honing.rewards.remote import VerifierClient
from honing.services.process import start_service


@pytest.mark.slow
def test_killing_a_replica_mid_run_loses_no_score():
    first, first_url = start_service("verifier", "--workers", "1")
    second, second_url = start_service("verifier", "--workers", "1")
    try:
        client = VerifierClient(
            [first_url, second_url], request_items=4, max_concurrency=4, backoff_s=0.01
        )
        items = [
            {"data_source": "arithmetic", "response": str(i), "ground_truth": str(i + i % 2)}
            for i in range(4000)
        ]
        warm = client.score_batch(items[:40])  # both replicas take traffic
        assert [r["score"] for r in warm] == [float(i % 2 == 0) for i in range(40)]
        killer = threading.Timer(0.1, first.send_signal, args=(signal.SIGKILL,))
        killer.start()
        results = client.score_batch(items[40:])
        killer.join()
        assert first.wait(timeout=10) == -signal.SIGKILL
        failures = [r for r in results if not isinstance(r, dict)]
        assert failures == []
        assert [r["score"] for r in results] == [float(i % 2 == 0) for i in range(40, 4000)]
        assert client.last_metrics["reward/errors"] >= 1  # the kill was seen and absorbed
        client.close()
    finally:
        for process in (first, second):
            process.kill()
            process.wait()
