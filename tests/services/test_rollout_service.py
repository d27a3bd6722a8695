"""The rollout server's guards: the token and bad bodies (over an engine that never
generates: these requests are answered before any generation), the bounds and ranges of a
completion request, and weight updates that do not fit the served model (over the micro model
served in process)."""

import json
import socket
from types import SimpleNamespace

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import save, save_file

from honing.models.loading import load_causal_lm, load_tokenizer
from honing.rollout.base import GenerationRequest, SamplingParams
from honing.rollout.native.engine import TransformersEngine
from honing.services.options import CompletionLimits
from honing.services.rollout import rollout_app

CPU = torch.device("cpu")

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


@pytest.fixture
def engine(micro_model_dir):
    """The micro model served in process (its own copy: tests change its weights)."""
    tokenizer = load_tokenizer(micro_model_dir)
    model = load_causal_lm(micro_model_dir, tokenizer, dtype="float32", device=CPU).eval()
    return TransformersEngine(model, tokenizer, device=CPU)


def _send(url: str, tensors: dict) -> httpx.Response:
    return httpx.post(f"{url}/update_weights?version=5", content=save(tensors), timeout=30)


def _message(answer: httpx.Response) -> str:
    return answer.json()["error"]["message"]


def test_weights_that_do_not_fit_are_refused_naming_the_tensor(serve, engine):
    url = serve(rollout_app(engine, model_name="m"))
    own = engine.model.state_dict()
    before = {name: tensor.clone() for name, tensor in own.items()}
    q = "model.layers.0.self_attn.q_proj.weight"  # [32, 32]
    embed = "model.embed_tokens.weight"  # [99, 32]
    for tensors, problem in (
        ({q: torch.ones(1, 32)}, f"weights: {q} has shape (1, 32); the served model's is (32, 32)"),
        ({embed: torch.tensor(0.5)}, f"weights: {embed} has shape (); the served model's is"),
        ({q: torch.full((32, 32), float("nan"))}, f"weights: {q} has non-finite values"),
        ({q: torch.full((32, 32), float("inf"))}, f"weights: {q} has non-finite values"),
        ({q: torch.ones(32, 32, dtype=torch.int64)}, f"weights: {q} has dtype torch.int64"),
        ({q: torch.full((32, 32), 1e6)}, None),  # fine in float32 (beyond float16's range)
    ):
        answer = _send(url, tensors)
        if problem is None:
            assert answer.status_code == 200
            own[q].copy_(before[q])
            continue
        assert answer.status_code == 400 and _message(answer).startswith(problem), tensors
    assert all(torch.equal(own[name], before[name]) for name in own)


def _greedy(url: str) -> list[dict]:
    prompt = {"prompt": [[5, 6, 7]], "max_tokens": 4, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json=prompt, timeout=30).json()["choices"]


def _served(url: str, engine) -> tuple[dict, dict, list[dict]]:
    """The served model's state, a copy of it, and its greedy answer before any update."""
    own = engine.model.state_dict()
    return own, {name: tensor.clone() for name, tensor in own.items()}, _greedy(url)


def test_a_weight_update_is_applied_all_or_nothing(serve, engine, tmp_path):
    """Every weight moved but one of the wrong size: nothing is applied, by either endpoint,
    and the server keeps its version and its samples."""
    url = serve(rollout_app(engine, model_name="m"))
    own, before, sampled = _served(url, engine)
    moved = {name: tensor + 0.5 for name, tensor in own.items()}
    moved["model.norm.weight"] = torch.ones(33)  # [32] in the model
    (tmp_path / "bad").mkdir()
    save_file(moved, tmp_path / "bad" / "model.safetensors")
    refused = [
        _send(url, moved),
        httpx.post(f"{url}/update_weights_from_disk", json={"model_path": str(tmp_path / "bad")}),
    ]
    for answer in refused:
        assert answer.status_code == 400
        assert _message(answer) == (
            "weights: model.norm.weight has shape (33,); the served model's is (32,)"
        )
    assert all(torch.equal(own[name], before[name]) for name in own)
    assert httpx.get(f"{url}/health").json()["weight_version"] == 0
    assert _greedy(url) == sampled
    del moved["model.norm.weight"]
    assert _send(url, moved).json() == {"success": True, "weight_version": 5}
    up = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(own[up], moved[up]) and not torch.equal(own[up], before[up])


def _bucket(url: str, update: str, part: int, tensors: dict) -> httpx.Response:
    path = f"/update_weights/bucket?update={update}&part={part}"
    return httpx.post(url + path, content=save(tensors), timeout=30)


def _commit(url: str, update: str, parts: int) -> httpx.Response:
    path = f"/update_weights/commit?update={update}&parts={parts}&version=5"
    return httpx.post(url + path, timeout=30)


def _cut_off(url: str, update: str, tensors: dict) -> None:
    """Bucket 0 of ``update`` whose connection is lost half-way through its body."""
    body = save(tensors)
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as connection:
        connection.sendall(
            f"POST /update_weights/bucket?update={update}&part=0 HTTP/1.1\r\n"
            f"Host: {host}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body[: len(body) // 2]
        )


def test_an_update_in_buckets_is_applied_by_its_commit_or_not_at_all(serve, engine):
    """Buckets are staged apart from the served weights: a refused bucket drops its update
    (the commit is refused), an update whose client went away mid-way (a bucket cut off, or
    no commit) is never applied, and nothing changes the version or the samples until an
    update whose every bucket came is committed."""
    url = serve(rollout_app(engine, model_name="m"))
    own, before, sampled = _served(url, engine)
    moved = {name: tensor + 0.5 for name, tensor in own.items()}
    names = sorted(moved)
    first = {name: moved[name] for name in names[: len(names) // 2]}
    second = {name: moved[name] for name in names[len(names) // 2 :]}
    norm = "model.norm.weight"
    assert _bucket(url, "a", 0, first).json() == {"success": True, "staged": 1}
    refused = _bucket(
        url, "a", 1, {k: v for k, v in second.items() if k != norm} | {norm: torch.ones(33)}
    )
    assert refused.status_code == 400
    assert _message(refused) == f"weights: {norm} has shape (33,); the served model's is (32,)"
    assert _message(_commit(url, "a", 2)) == "update: a is not staged (dropped or never begun)"
    for answer, problem in (
        (_bucket(url, "b", 0, first), None),
        (_bucket(url, "b", 2, second), "part: expected 1, got 2"),  # and b is dropped
        (_bucket(url, "b", 1, second), "update: b is not in progress (its first part is 0)"),
        (_bucket(url, "c", 0, first), None),
        (_bucket(url, "c", 1, first), f"weights: {names[0]} came twice in update c"),
        (_bucket(url, "d", 0, first), None),
        (_commit(url, "d", 2), "parts: 2 sent, 1 staged; the update is dropped"),
        (httpx.post(f"{url}/update_weights/bucket?part=0", content=b""), "update: expected"),
        (httpx.post(f"{url}/update_weights/commit?update=e", content=b""), "parts: missing"),
        (_bucket(url, "f", 0, first), None),  # its client goes: never committed
    ):
        if problem is None:
            assert answer.status_code == 200, answer.text
        else:
            assert answer.status_code == 400 and _message(answer).startswith(problem)
    _cut_off(url, "g", second)
    assert all(torch.equal(own[name], before[name]) for name in own)
    assert httpx.get(f"{url}/health").json()["weight_version"] == 0
    assert _greedy(url) == sampled
    assert _bucket(url, "h", 0, first).status_code == 200
    assert _bucket(url, "h", 1, second).json() == {"success": True, "staged": 2}
    assert _commit(url, "h", 2).json() == {"success": True, "weight_version": 5}
    assert all(torch.equal(own[name], moved[name]) for name in own)


def _complete(url: str, **fields) -> httpx.Response:
    body = {"prompt": [[5, 6, 7]], "max_tokens": 2} | fields
    return httpx.post(f"{url}/v1/completions", json=body, timeout=30)


def test_requests_past_the_servers_bounds_are_400(serve, engine):
    url = serve(rollout_app(engine, model_name="m", limits=CompletionLimits(16, 6, 8)))
    for fields, problem in (
        ({"n": 9}, "n: expected 1..8, got 9"),
        (
            {"n": 3, "prompt": [[5], [6], [7]]},
            "n: 3 prompts x n=3 are 9 completions, over this server's --max-sequences 8",
        ),
        ({"max_tokens": 7}, "max_tokens: expected 1..6, got 7"),
        (
            {"prompt": [[5] * 16]},
            "prompt[0]: 16 tokens leave no room for a response under this server's "
            "--max-seq-len 16",
        ),
        ({"prompt": "1" * 16}, "prompt[0]: 16 tokens leave no room"),
        ({"n": 1e30}, "n: expected 1..8, got 1e+30"),
        ({"n": "1e30"}, "n: expected 1..8, got 1e30"),
        ({"max_tokens": 10**40}, "max_tokens: expected 1..6, got 1000"),
        ({"prompt": [[5]] * 100_000}, "n: 100000 prompts x n=1 are 100000 completions"),
    ):
        answer = _complete(url, **fields)
        assert answer.status_code == 400 and _message(answer).startswith(problem), fields
    within = _complete(url, n=4, prompt=[[5], [6]], max_tokens=6)
    assert within.status_code == 200 and len(within.json()["choices"]) == 8


def test_values_a_sampler_cannot_take_are_400_naming_the_field(serve, engine):
    url = serve(rollout_app(engine, model_name="m"))
    for fields, problem in (
        ({"prompt": [5, 99]}, "prompt[0]: token id 99 is outside the model's vocabulary (0..98)"),
        ({"prompt": [[5], [-1]]}, "prompt[1]: token id -1 is outside the model's vocabulary"),
        ({"prompt": [5, True]}, "prompt: expected token ids or text"),
        ({"prompt": ""}, "prompt[0]: empty"),
        ({"top_p": 0}, "top_p: expected > 0 and <= 1, got 0"),
        ({"top_p": -0.5}, "top_p: expected > 0 and <= 1, got -0.5"),
        ({"top_p": 1.5}, "top_p: expected > 0 and <= 1, got 1.5"),
        ({"temperature": "nan"}, "temperature: expected >= 0, got nan"),
        ({"temperature": "inf"}, "temperature: expected >= 0, got inf"),
        ({"temperature": -1}, "temperature: expected >= 0, got -1"),
        ({"temperature": "hot"}, "temperature: expected a number, got 'hot'"),
        ({"top_k": -2}, "top_k: expected >= -1, got -2"),
        ({"seed": 2**70}, "seed: expected"),
        ({"n": 2.5}, "n: expected a whole number, got 2.5"),
        ({"n": True}, "n: expected a number, got 'True'"),
        ({"max_tokens": 0}, "max_tokens: expected 1..4096, got 0"),
        ({"stop_token_ids": [5, "x"]}, "stop_token_ids: expected a list of at most 1024 token"),
    ):
        answer = _complete(url, **fields)
        assert answer.status_code == 400 and _message(answer).startswith(problem), fields
    fine = _complete(url, prompt=[5, 98], temperature=1e-6, top_p=1, top_k=-1, seed=-1)
    assert fine.status_code == 200
    greedy = _complete(url, prompt=[5, 98], temperature=0)
    assert fine.json()["choices"][0]["token_ids"] == greedy.json()["choices"][0]["token_ids"]


def test_a_request_s_stop_token_ids_end_its_responses(serve, engine):
    """``stop_token_ids`` (how the turn loop ends a turn at a tool call's closing tag): each
    greedy response ends at the first of them it samples, as ``stop``."""
    url = serve(rollout_app(engine, model_name="m"))
    free = _complete(url, prompt=[5, 98], temperature=0, max_tokens=8).json()["choices"][0]
    ids = free["token_ids"]
    cut = _complete(url, prompt=[5, 98], temperature=0, max_tokens=8, stop_token_ids=[ids[1]])
    choice = cut.json()["choices"][0]
    assert choice["token_ids"] == ids[: ids.index(ids[1]) + 1]
    assert choice["finish_reason"] == "stop"


def test_stop_token_ids_must_be_a_bounded_list_of_the_models_token_ids(serve, engine):
    url = serve(rollout_app(engine, model_name="m"))
    expected = "stop_token_ids: expected a list of at most 1024 token ids in 0..98"
    for ids, got in (
        ([2**63], f"got {2**63}"),
        ([5, 99], "got 99"),
        ([-1], "got -1"),
        ([5, 1.5], "got 1.5"),
        ([True], "got True"),
        ("5", "got '5'"),
        (list(range(99)) * 2021, "got 200079 of them"),
    ):
        answer = _complete(url, stop_token_ids=ids)
        assert answer.status_code == 400, ids[:3]
        assert _message(answer) == f"{expected}, {got}", ids[:3]
    assert _complete(url, stop_token_ids=[0, 98] * 512).status_code == 200
    assert _complete(url, stop_token_ids=None).status_code == 200


def test_the_engine_refuses_stop_ids_outside_the_vocabulary(engine):
    request = [GenerationRequest("0", [5, 6], 0)]
    for stop in (2**63, 99, -1):
        with pytest.raises(ValueError, match=rf"stop_ids: {stop} is not a token id of this model"):
            engine.generate(request, SamplingParams(max_new_tokens=2, stop_ids=(stop,)))
    assert len(engine.generate(request, SamplingParams(max_new_tokens=2, stop_ids=(98,)))) == 1


def test_prompts_that_cannot_be_tokenized_are_400(serve, engine):
    """A lone surrogate (valid JSON, not valid Unicode) in a completion's or a tokenize
    request's text."""
    url = serve(rollout_app(engine, model_name="m"))
    for path, body, problem in (
        ("/v1/completions", '{"prompt": "a\\ud800b"}', "prompt[0]: not valid Unicode"),
        ("/v1/completions", '{"prompt": ["ok", "\\udfff"]}', "prompt[1]: not valid Unicode"),
        ("/tokenize", '{"prompt": "\\ud800"}', "prompt: not valid Unicode"),
    ):
        answer = httpx.post(f"{url}{path}", content=body, timeout=30)
        assert answer.status_code == 400, body
        assert _message(answer).startswith(problem), body


def test_no_completion_body_is_answered_500(serve, engine):
    """Odd bodies, each refused with a 4xx naming the field."""
    url = serve(rollout_app(engine, model_name="m"))
    huge = 2**64
    for fields in (
        {"prompt": [[huge]]},
        {"prompt": [huge, 5]},
        {"prompt": [[5], "\ud800"]},
        {"prompt": {"a": 1}},
        {"prompt": [[5], {"a": 1}]},
        {"prompt": [[]]},
        {"n": huge},
        {"max_tokens": -huge},
        {"seed": "1e400"},
        {"top_p": "-inf"},
        {"temperature": [1]},
        {"stop_token_ids": {"a": 1}},
        {"stop_token_ids": [[5]]},
        {"stop_token_ids": [huge] * 2000},
    ):
        body = json.dumps({"prompt": [[5, 6, 7]], "max_tokens": 2} | fields)  # \ud800 escaped
        answer = httpx.post(f"{url}/v1/completions", content=body, timeout=30)
        assert 400 <= answer.status_code < 500, fields
        field_name = next(iter(fields))
        assert _message(answer).split("[", 1)[0].startswith(field_name), (fields, _message(answer))
    for body in ('{"prompt": "\\ud800", "add_special_tokens": []}', '{"prompt": 5}'):
        answer = httpx.post(f"{url}/tokenize", content=body, timeout=30)
        assert answer.status_code == 400 and _message(answer).startswith("prompt"), body


def test_metrics_carry_any_model_name_escaped(serve):
    """A served name with a quote, a backslash and a newline: escaped in its label, and read
    back whole by Prometheus's own parser."""
    name = 'my "best"\\model\nv2'
    url = serve(rollout_app(_idle_engine(), model_name=name))
    text = httpx.get(f"{url}/metrics").text
    assert 'model_name="my \\"best\\"\\\\model\\nv2"' in text
    families = {family.name: family for family in text_string_to_metric_families(text)}
    for key in ("drafts", "draft_tokens", "accepted_tokens"):
        (sample,) = families[f"vllm:spec_decode_num_{key}"].samples
        assert sample.name == f"vllm:spec_decode_num_{key}_total"
        assert sample.labels == {"model_name": name} and sample.value == 0.0
    assert families["honing_requests"].type == "counter"
