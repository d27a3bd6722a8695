"""The verifier-service client against real HTTP servers on loopback; every fault test runs
for the generative judge's client too (the same machinery behind its completions protocol)."""

import contextlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from honing.rewards import Scorer
from honing.rewards.judge import JudgeClient
from honing.rewards.remote import VerifierClient, VerifierUnavailable, retry_after_s, score_url
from honing.types import Prompt, Rollout

JUDGE_TEMPLATE = "A={answer};R={reference}"


def _judged(prompt: str) -> str:
    """The fake judge's reply to a ``JUDGE_TEMPLATE`` prompt."""
    answer, reference = (part.split("=", 1)[1] for part in prompt.split(";"))
    return f"Score: {int(answer.strip() == reference)}"


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 - http.server's name
        server = self.server
        server.calls += 1
        server.auth.append(self.headers.get("Authorization"))
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        judge = self.path.endswith("/v1/completions")
        server.sizes.append(len(body["prompt"] if judge else body["items"]))
        status = server.statuses.pop(0) if server.statuses else 200
        if status != 200:
            self.send_response(status)
            if server.retry_after is not None:
                self.send_header("Retry-After", server.retry_after)
            self.end_headers()
            self.wfile.write(b"nope")
            return
        if judge:  # an OpenAI completions answer, one choice per prompt
            choices = [{"index": i, "text": _judged(p)} for i, p in enumerate(body["prompt"])]
            return self._send({"choices": choices})
        results = []
        for item in body["items"]:
            if item["response"] == "crash":
                results.append({"score": None, "error": "verifier bug"})
                continue
            correct = item["response"].strip() == str(item["ground_truth"])
            results.append({"score": float(correct), "details": {"seen": item["data_source"]}})
        self._send({"results": results})

    def _send(self, answer):
        payload = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        with contextlib.suppress(OSError):  # the client gave up (a hanging server's test)
            self.wfile.write(payload)

    def log_message(self, *args):
        pass


def _start(statuses=(), retry_after=None):
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.calls, httpd.sizes, httpd.auth, httpd.statuses = 0, [], [], list(statuses)
    httpd.retry_after = retry_after
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, f"http://127.0.0.1:{httpd.server_address[1]}"


CLIENTS = {
    "verifier": VerifierClient,
    "judge": lambda *args, **kw: JudgeClient(*args, model="m", template=JUDGE_TEMPLATE, **kw),
}


@pytest.fixture(params=list(CLIENTS))
def make(request):
    """The client of each protocol: ``make(endpoints, **options)``."""
    return CLIENTS[request.param]


@pytest.fixture
def server():
    httpd, url = _start()
    yield httpd, url
    httpd.shutdown()


def _items(*pairs, source="math"):
    return [{"response": r, "ground_truth": g, "data_source": source} for r, g in pairs]


def test_score_url_accepts_base_or_score_path():
    assert score_url("http://h:1") == "http://h:1/score"
    assert score_url("http://h:1/score/") == "http://h:1/score"


def test_scores_in_order_with_details(make, server):
    httpd, url = server
    client = make(url, request_items=2)
    results = client.score_batch(_items(("1", "1"), ("2", "3"), ("4", "4")))
    assert [r["score"] for r in results] == [1.0, 0.0, 1.0]
    assert make is CLIENTS["judge"] or results[0]["seen"] == "math"  # a verifier's details
    assert sorted(httpd.sizes) == [1, 2]  # chunked by request_items
    assert client.last_metrics["reward/requests"] == 2 and len(client.last_latencies_ms) == 2
    client.close()


def test_cache_and_duplicates_are_not_sent_twice(make, server):
    httpd, url = server
    client = make(url)
    client.score_batch(_items(("1", "1"), ("1", "1"), ("2", "2")))
    assert httpd.sizes == [2]
    again = client.score_batch(_items(("1", "1"), ("2", "2")))
    assert [r["score"] for r in again] == [1.0, 1.0]
    assert httpd.calls == 1 and client.last_metrics["reward/cache_hits"] == 2
    client.close()


def test_retries_server_errors_then_succeeds(make):
    httpd, url = _start(statuses=[500, 503])
    client = make(url, retries=2, backoff_s=0.01, eject_after=5)
    assert client.score_batch(_items(("7", "7")))[0]["score"] == 1.0
    assert httpd.calls == 3 and client.last_metrics["reward/retries"] == 2
    client.close()
    httpd.shutdown()


def test_gives_up_with_a_reason_and_the_scorer_counts_it(make):
    httpd, url = _start(statuses=[500] * 10)
    client = make(url, retries=1, backoff_s=0.01)
    [result] = client.score_batch(_items(("7", "7")))
    assert isinstance(result, VerifierUnavailable)
    assert "HTTP 500" in str(result) and "after 2 attempt" in str(result)
    scorer = Scorer(client, on_error="zero")
    [score] = scorer.score({"p1": Prompt("p1", "q", "7")}, [_rollout("7")])
    assert not score.ok and score.reward == 0.0 and "HTTP 500" in score.details["error"]
    client.close()
    httpd.shutdown()


@pytest.mark.alone
def test_a_busy_service_is_waited_for_as_long_as_it_asks(make):
    httpd, url = _start(statuses=[503, 429], retry_after="1")
    client = make(url, retries=0, backoff_s=0.01, timeout_s=10)
    start = time.perf_counter()
    [result] = client.score_batch(_items(("7", "7")))
    elapsed = time.perf_counter() - start
    assert result["score"] == 1.0 and httpd.calls == 3  # busy answers use no retries
    assert 2.0 <= elapsed < 5.0  # waited the 1 s asked, twice (not 0.01 s)
    assert client.last_metrics["reward/retries"] == 2
    client.close()
    httpd.shutdown()


@pytest.mark.alone
def test_a_wait_past_the_timeout_fails_at_once_with_the_reason(make):
    httpd, url = _start(statuses=[503] * 5, retry_after="60")
    client = make(url, retries=3, timeout_s=2)
    start = time.perf_counter()
    [result] = client.score_batch(_items(("7", "7")))
    assert time.perf_counter() - start < 1.0 and httpd.calls == 1
    assert isinstance(result, VerifierUnavailable)
    assert "HTTP 503" in str(result) and "still busy" in str(result)
    client.close()
    httpd.shutdown()


def test_retry_after_in_seconds_or_as_a_date():
    assert retry_after_s("3") == 3.0 and retry_after_s("-1") == 0.0
    soon = time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(time.time() + 30))
    assert 25 < retry_after_s(soon) <= 30
    assert retry_after_s("soon") is None and retry_after_s(None) is None


def test_backoff_doubles_with_jitter():
    client = VerifierClient("http://127.0.0.1:9", backoff_s=1.0)
    first, third = [client._backoff(1) for _ in range(50)], [client._backoff(3) for _ in range(50)]
    assert all(0.5 <= w <= 1.5 for w in first) and all(2.0 <= w <= 6.0 for w in third)
    assert len(set(first)) > 1  # not every client comes back at the same instant
    client.close()


def test_client_errors_are_not_retried(make):
    httpd, url = _start(statuses=[422])
    client = make(url, retries=3, backoff_s=0.01)
    [result] = client.score_batch(_items(("7", "7")))
    assert isinstance(result, VerifierUnavailable) and "HTTP 422" in str(result)
    assert httpd.calls == 1
    client.close()
    httpd.shutdown()


def test_an_item_the_service_could_not_score_is_a_failure(server):
    _, url = server
    client = VerifierClient(url)
    ok, bad = client.score_batch(_items(("1", "1"), ("crash", "1")))
    assert ok["score"] == 1.0
    assert isinstance(bad, VerifierUnavailable) and "verifier bug" in str(bad)
    client.close()


def test_dead_replica_is_ejected_and_every_item_is_scored(make, server):
    httpd, live = server
    dead = "http://127.0.0.1:9"  # nothing listens on the discard port
    client = make([dead, live], request_items=1, max_concurrency=1, backoff_s=0.0)
    results = client.score_batch(_items(*[(str(i), str(i)) for i in range(20)]))
    assert [r["score"] for r in results] == [1.0] * 20
    assert client.last_metrics["reward/ejections"] == 1
    assert client.last_metrics["reward/errors"] == 2  # then the dead one gets no traffic
    assert httpd.calls == 20
    client.close()


@pytest.mark.alone
def test_circuit_breaker_fails_fast_when_the_service_is_down(make):
    client = make("http://127.0.0.1:9", retries=0, breaker_failures=2, breaker_s=30, eject_after=99)
    client.score_batch(_items(("1", "1"), ("2", "2"), source="a"))  # 1 request, 1 failure
    client.score_batch(_items(("3", "3")))  # 2nd failure opens the circuit
    start = time.perf_counter()
    [result] = client.score_batch(_items(("4", "4")))
    assert "circuit open" in str(result) and time.perf_counter() - start < 0.5
    assert client.last_metrics["reward/requests"] == 0
    client.close()


def test_bearer_token_from_the_environment(make, server, monkeypatch):
    httpd, url = server
    monkeypatch.setenv("HONING_VERIFIER_TOKEN", "s3cret")
    client = make(url)
    client.score_batch(_items(("1", "1")))
    assert httpd.auth == ["Bearer s3cret"]
    client.close()


def _rollout(text):
    return Rollout("p1", 0, [1], [2], [0.0], "stop", 0, text)
