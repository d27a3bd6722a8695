"""The verifier service's envelope and guards, served by uvicorn on loopback."""

import threading
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from honing.services.app import create_app
from honing.services.verifier import verifier_app
from tests.services._metrics import scraped, value


def _post(url, payload, **kwargs):
    return httpx.post(f"{url}/score", json=payload, timeout=30, **kwargs)


def test_scores_routed_items_in_order(serve):
    url = serve(verifier_app(workers=1))
    items = [
        {"data_source": "arithmetic", "response": "12", "ground_truth": "12"},
        {"data_source": "arithmetic", "response": "13", "ground_truth": "12"},
        {"data_source": "unknown_set", "response": "1", "ground_truth": "1"},
    ]
    answer = _post(url, {"items": items})
    assert answer.status_code == 200
    first, second, third = answer.json()["results"]
    assert (first["score"], second["score"]) == (1.0, 0.0)
    assert first["details"]["verdict"] == "correct"
    assert third["score"] is None and "no reward function" in third["error"]
    health = httpx.get(f"{url}/health").json()
    assert health["status"] == "ok" and "openai/gsm8k" in health["routes"]
    metrics = scraped(url)
    assert value(metrics, "honing_requests_total", service="verifier", code="200") == 1
    assert value(metrics, "honing_items_total", service="verifier", verdict="correct") == 1
    assert value(metrics, "honing_request_seconds_count", service="verifier") == 1


def test_token_is_required_when_configured(serve):
    url = serve(verifier_app(workers=1, token="s3cret"))
    payload = {"items": [{"data_source": "arithmetic", "response": "1", "ground_truth": "1"}]}
    assert _post(url, payload).status_code == 401
    wrong = _post(url, payload, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    right = _post(url, payload, headers={"Authorization": "Bearer s3cret"})
    assert right.status_code == 200 and right.json()["results"][0]["score"] == 1.0


def test_bad_requests_say_what_is_wrong(serve):
    url = serve(verifier_app(workers=1, max_body_bytes=2000))
    too_big = _post(url, {"items": [{"response": "x" * 5000}]})
    assert too_big.status_code == 413 and "limit" in too_big.json()["error"]
    not_json = httpx.post(f"{url}/score", content=b"{nope", timeout=10)
    assert not_json.status_code == 422 and "not JSON" in not_json.json()["error"]
    bad_item = _post(
        url, {"items": [{"response": "1", "ground_truth": "1"}, {"response": 5, "ground_truth": 5}]}
    )
    assert bad_item.status_code == 422
    assert bad_item.json()["error"] == "items[1].response: expected a string"
    assert _post(url, {"item": []}).json()["error"] == 'expected {"items": [...]}'


def test_items_without_a_response_or_ground_truth_are_422(serve):
    url = serve(verifier_app(workers=1))
    needs = "(every item needs response, ground_truth)"
    for item, field in (
        ({"data_source": "arithmetic", "response": "12"}, "ground_truth"),
        ({"data_source": "arithmetic", "response": "12", "ground_truth": None}, "ground_truth"),
        ({"data_source": "arithmetic", "ground_truth": "12"}, "response"),
    ):
        answer = _post(url, {"items": [item]})
        assert answer.status_code == 422
        assert answer.json()["error"] == f"items[0].{field}: missing or null {needs}"
    accepted = [  # the ground truths the verifiers take: text, numbers, lists, test objects
        {"data_source": "arithmetic", "response": "12", "ground_truth": 12},
        {"data_source": "arithmetic", "response": "12", "ground_truth": ["11", "12"]},
        {"data_source": "code", "response": "x", "ground_truth": {"tests": []}},
    ]
    answer = _post(url, {"items": accepted})
    assert answer.status_code == 200
    assert [r["score"] for r in answer.json()["results"]][:2] == [1.0, 1.0]


def test_json_nested_too_deeply_is_422_not_a_crash(serve):
    url = serve(verifier_app(workers=1))
    depth = 100_000
    for body in (
        '{"items": ' + "[" * depth + "]" * depth + "}",
        '{"a": ' * depth + "1" + "}" * depth,
    ):
        answer = httpx.post(f"{url}/score", content=body, timeout=10)
        assert answer.status_code == 422
        assert answer.json()["error"] == "body is nested too deeply to parse"
    item = {"data_source": "arithmetic", "response": "1", "ground_truth": "1"}
    assert _post(url, {"items": [item]}).json()["results"][0]["score"] == 1.0


def test_with_a_token_health_is_bare_and_metrics_need_it(serve):
    url = serve(verifier_app(workers=1, token="s3cret"))
    refused = _post(url, {"items": []})
    assert refused.status_code == 401
    for headers in ({}, {"Authorization": "Bearer nope"}):
        health = httpx.get(f"{url}/health", headers=headers)
        assert health.status_code == 200 and health.json() == {"status": "ok"}
        metrics = httpx.get(f"{url}/metrics", headers=headers)
        assert metrics.status_code == 401 and metrics.json() == refused.json()
    right = {"Authorization": "Bearer s3cret"}
    health = httpx.get(f"{url}/health", headers=right).json()
    assert health["service"] == "verifier" and "openai/gsm8k" in health["routes"]
    assert "isolation" in health and "in_flight" in health
    metrics = httpx.get(f"{url}/metrics", headers=right)
    assert metrics.status_code == 200 and 'code="401"' in metrics.text


class _Slow:
    def __init__(self):
        self.release = threading.Event()

    def score_batch(self, items):
        self.release.wait(10)
        return [{"score": 1.0} for _ in items]


def test_back_pressure_refuses_past_the_queue(serve):
    scorer = _Slow()
    url = serve(create_app(scorer, service="t", max_concurrency=1, max_queue=1))
    payload = {"items": [{"response": "a"}]}
    answers = []
    threads = [threading.Thread(target=lambda: answers.append(_post(url, payload))) for _ in "ab"]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 5
    while httpx.get(f"{url}/health").json()["waiting"] < 1:  # one scoring, one waiting
        assert time.monotonic() < deadline
        time.sleep(0.01)
    refused = _post(url, payload)
    assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
    scorer.release.set()
    for thread in threads:
        thread.join()
    assert [a.status_code for a in answers] == [200, 200]


def test_scorer_crash_is_a_500_not_a_dead_server(serve):
    class Broken:
        def score_batch(self, items):
            raise RuntimeError("boom")

    url = serve(create_app(Broken(), service="t"))
    answer = _post(url, {"items": [{"response": "a"}]})
    assert answer.status_code == 500 and "RuntimeError: boom" in answer.json()["error"]
    assert httpx.get(f"{url}/health").status_code == 200


def test_math_and_code_items_in_one_request(serve):
    url = serve(verifier_app(workers=1, code_timeout_s=5.0))
    program = "```python\nprint(int(input()) * 2)\n```"
    items = [
        {
            "data_source": "lighteval/MATH",
            "response": "so $\\boxed{\\dfrac{1}{2}}$",
            "ground_truth": "0.5",
        },
        {"data_source": "math", "response": "The answer is 3", "ground_truth": "\\frac{6}{3}"},
        {
            "data_source": "code",
            "response": program,
            "ground_truth": {"tests": [{"stdin": "4\n", "stdout": "8\n"}]},
        },
        {
            "data_source": "apps",
            "response": program,
            "ground_truth": {"tests": [{"stdin": "4\n", "stdout": "9\n"}]},
        },
    ]
    results = _post(url, {"items": items}).json()["results"]
    assert [r["score"] for r in results] == [1.0, 0.0, 1.0, 0.0]
    assert [r["details"]["verdict"] for r in results] == ["correct", "wrong", "passed", "failed"]
    assert results[2]["details"]["isolation"] in ("bwrap", "unshare", "none")


def test_metrics_escape_label_values_and_parse(serve):
    """A verdict (the scorer's own words) with a quote, a backslash and a newline becomes a
    label value that Prometheus's parser reads back whole, beside every other series."""
    verdict = 'off by "one"\\\nagain'

    class Odd:
        def score_batch(self, items):
            return [{"score": 0.5, "verdict": verdict} for _ in items]

    url = serve(create_app(Odd(), service="t"))
    assert _post(url, {"items": [{"response": "a"}, {"response": "b"}]}).status_code == 200
    assert _post(url, {"items": "no"}).status_code == 422
    text = httpx.get(f"{url}/metrics").text
    families = {family.name: family for family in text_string_to_metric_families(text)}
    items = families["honing_items"].samples
    assert [(s.name, s.labels, s.value) for s in items] == [
        ("honing_items_total", {"service": "t", "verdict": verdict}, 2.0)
    ]
    requests = {s.labels["code"]: s.value for s in families["honing_requests"].samples}
    assert requests == {"200": 1.0, "422": 1.0}
    latency = {s.name: s for s in families["honing_request_seconds"].samples}
    assert latency["honing_request_seconds_count"].value == 1.0
    assert {s.labels.get("le") for s in families["honing_request_seconds"].samples} >= {
        "0.005",
        "1.0",
        "30.0",
        "+Inf",
    }
    assert families["honing_in_flight"].samples[0].value == 0.0
    assert families["honing_waiting"].type == "gauge"
