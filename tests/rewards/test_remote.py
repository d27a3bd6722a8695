"""The HTTP verifier client against a real server on loopback."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from honing.rewards import Scorer
from honing.rewards.remote import VerifierUnavailable, remote_reward_fn
from honing.types import Prompt, Rollout


class _Verifier(BaseHTTPRequestHandler):
    calls = 0
    fail_first = 0

    def do_POST(self):  # noqa: N802 - http.server's name
        type(self).calls += 1
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if type(self).calls <= type(self).fail_first:
            self.send_response(503)
            self.end_headers()
            return
        correct = body["response"].strip() == str(body["ground_truth"])
        payload = json.dumps({"score": float(correct), "seen_source": body["data_source"]})
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(payload.encode())

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    _Verifier.calls, _Verifier.fail_first = 0, 0
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Verifier)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/score"
    httpd.shutdown()


def test_scores_through_the_service(server):
    fn = remote_reward_fn(server, timeout_s=5)
    assert fn("42", "42", prompt="p", data_source="math", extra_info={})["score"] == 1.0
    result = fn("41", "42", prompt="p", data_source="math", extra_info={})
    assert result == {"score": 0.0, "seen_source": "math"}


def test_retries_server_errors_then_succeeds(server):
    _Verifier.fail_first = 2
    fn = remote_reward_fn(server, timeout_s=5, retries=2, backoff_s=0.01)
    assert fn("7", "7", prompt="", data_source="", extra_info={})["score"] == 1.0
    assert _Verifier.calls == 3


def test_gives_up_with_a_reason(server):
    _Verifier.fail_first = 10
    fn = remote_reward_fn(server, timeout_s=5, retries=1, backoff_s=0.01)
    with pytest.raises(VerifierUnavailable, match="HTTP 503 .* after 2 attempt"):
        fn("7", "7", prompt="", data_source="", extra_info={})


def test_unreachable_service_is_recorded_by_the_scorer_policy():
    fn = remote_reward_fn("http://127.0.0.1:9/score", timeout_s=1, retries=0)
    scorer = Scorer(fn, on_error="zero")
    prompt = Prompt("p1", "1+1=", "2")
    rollout = Rollout("p1", 0, [1], [2], [0.0], "stop", 0, "2")
    [score] = scorer.score({"p1": prompt}, [rollout])
    assert not score.ok and score.reward == 0.0
    assert "unreachable" in score.details["error"]
