"""The rollout server's guards (token, bodies), over an engine that never generates: these
requests are answered before any generation."""

from types import SimpleNamespace

import httpx

from honing.services.rollout import rollout_app

_UNAUTHORISED = "missing or wrong bearer token (Authorization: Bearer ...)"


def _idle_engine():
    return SimpleNamespace(weight_version=3, fast_decode_reason="off", tokenizer=None)


def test_with_a_token_health_is_bare_and_the_rest_needs_it(serve):
    url = serve(rollout_app(_idle_engine(), model_name="/models/secret-path", token="s3cret"))
    for headers in ({}, {"Authorization": "Bearer nope"}):
        health = httpx.get(f"{url}/health", headers=headers)
        assert health.status_code == 200 and health.json() == {"status": "ok"}
        for path in ("/metrics", "/v1/models"):
            answer = httpx.get(f"{url}{path}", headers=headers)
            assert answer.status_code == 401
            assert answer.json()["error"]["message"] == _UNAUTHORISED
    right = {"Authorization": "Bearer s3cret"}
    health = httpx.get(f"{url}/health", headers=right).json()
    assert health["model"] == "/models/secret-path" and health["weight_version"] == 3
    assert httpx.get(f"{url}/metrics", headers=right).status_code == 200
    models = httpx.get(f"{url}/v1/models", headers=right).json()
    assert models["data"][0]["id"] == "/models/secret-path"


def test_without_a_token_everything_is_open(serve):
    url = serve(rollout_app(_idle_engine(), model_name="m"))
    assert httpx.get(f"{url}/health").json()["weight_version"] == 3
    assert "vllm:spec_decode_num_drafts_total" in httpx.get(f"{url}/metrics").text
    assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "m"


def test_bad_bodies_are_400_naming_the_problem(serve):
    url = serve(rollout_app(_idle_engine(), model_name="m"))
    depth = 100_000
    for path in ("/v1/completions", "/update_weights_from_disk"):
        for body, error in (
            ('{"prompt": ' + "[" * depth + "]" * depth + "}", "body: nested too deeply to parse"),
            ('{"a": ' * depth + "1" + "}" * depth, "body: nested too deeply to parse"),
            ("[1, 2]", "body: expected a JSON object"),
        ):
            answer = httpx.post(f"{url}{path}", content=body, timeout=10)
            assert answer.status_code == 400, (path, body[:20])
            assert answer.json()["error"]["message"] == error
    assert httpx.get(f"{url}/health").status_code == 200
