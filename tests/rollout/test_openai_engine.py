"""Remote rollout engines: ``honing serve rollout`` processes on loopback, driven by
``OpenAIEngine`` the way it would drive vLLM or SGLang servers."""

import errno
import json
import os

import httpx
import pytest
import torch

from honing.errors import UserError
from honing.models.loading import load_causal_lm, load_tokenizer
from honing.rollout.base import GenerationRequest, SamplingParams
from honing.rollout.remote.engine import (
    EngineRequestError,
    EngineUnavailable,
    OpenAIEngine,
    _counters,
)
from honing.services.process import start_service as process_start_service
from tests.warm import start_service

pytestmark = pytest.mark.slow  # servers booted per module, runs against them

CPU = torch.device("cpu")
PROMPTS = ["12+34=", "7+8=", "55+45="]


@pytest.fixture(scope="module")
def servers(micro_model_dir):
    started = [start_service("rollout", "--model", str(micro_model_dir)) for _ in range(2)]
    yield [url for _, url in started]
    for process, _ in started:
        process.kill()
        process.wait()


@pytest.fixture(scope="module")
def tokenizer(micro_model_dir):
    return load_tokenizer(micro_model_dir)


@pytest.fixture(scope="module")
def model(micro_model_dir, tokenizer):
    return load_causal_lm(micro_model_dir, tokenizer, dtype="float32", device=CPU).eval()


def requests_for(tokenizer):
    return [
        GenerationRequest(f"p{i}", tokenizer(text, add_special_tokens=False)["input_ids"], i)
        for i, text in enumerate(PROMPTS)
    ]


def teacher_forced_logprobs(model, prompt_ids, response_ids):
    ids = torch.tensor([prompt_ids + response_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(response_ids)[:, None]).squeeze(-1)


def test_groups_come_back_with_token_ids_and_their_sampling_logprobs(servers, tokenizer, model):
    engine = OpenAIEngine(servers, tokenizer)
    params = SamplingParams(n=4, max_new_tokens=5, max_seq_len=64, seed=3)
    rollouts = engine.generate(requests_for(tokenizer), params)
    assert len(rollouts) == 12
    assert [r.group_index for r in rollouts] == [0] * 4 + [1] * 4 + [2] * 4
    for r in rollouts:
        assert 1 <= len(r.response_ids) <= 5 and r.finish_reason in ("stop", "length")
        want = teacher_forced_logprobs(model, r.prompt_ids, r.response_ids)
        torch.testing.assert_close(torch.tensor(r.behaviour_logprobs), want, atol=1e-4, rtol=0)
    again = engine.generate(requests_for(tokenizer), params)
    assert [r.response_ids for r in again] == [r.response_ids for r in rollouts]  # seeded
    engine.close()


def test_weights_sent_as_tensors_and_from_disk_change_what_is_sampled(
    servers, tokenizer, model, tmp_path
):
    greedy = SamplingParams(n=1, max_new_tokens=4, max_seq_len=64, greedy=True)
    local = load_causal_lm(model.name_or_path, tokenizer, dtype="float32", device=CPU).eval()
    with torch.no_grad():
        for parameter in local.parameters():  # tied embeddings stay tied
            parameter.add_(0.5 * torch.randn_like(parameter))
    changed = local.state_dict()
    want = []
    for request in requests_for(tokenizer):
        with torch.no_grad():
            ids = torch.tensor([request.prompt_ids])
            for _ in range(4):
                ids = torch.cat([ids, local(ids).logits[:, -1].argmax(-1, keepdim=True)], -1)
        want.append(ids[0, len(request.prompt_ids) :].tolist())

    for sync in ("tensors", "disk"):
        engine = OpenAIEngine(
            servers,
            tokenizer,
            weight_sync=sync,
            weight_dir=str(tmp_path / "weights"),
            model_dir=model.name_or_path,
        )
        engine.load_weights(7, [list(changed.items())])
        rollouts = engine.generate(requests_for(tokenizer), greedy)
        for r, tokens in zip(rollouts, want, strict=True):
            stop = next((i + 1 for i, t in enumerate(tokens) if t in engine.stop_ids), 4)
            assert r.response_ids == tokens[:stop], sync
            assert r.weight_version == 7
        engine.load_weights(0, [list(model.state_dict().items())])  # back, for the others
        engine.close()
    assert [p.name for p in (tmp_path / "weights").iterdir()] == ["v0"]  # others removed


def test_a_dead_endpoint_is_set_aside_and_its_requests_regenerated(micro_model_dir, tokenizer):
    # started afresh: a killed server is gone (nothing listens) once its process is reaped
    process, url = process_start_service("rollout", "--model", str(micro_model_dir))
    spare, spare_url = process_start_service("rollout", "--model", str(micro_model_dir))
    try:
        engine = OpenAIEngine([url, spare_url], tokenizer, cooldown_s=60)
        params = SamplingParams(n=2, max_new_tokens=3, max_seq_len=64)
        assert len(engine.generate(requests_for(tokenizer), params)) == 6
        process.kill()
        process.wait()
        rollouts = engine.generate(requests_for(tokenizer) * 2, params)
        assert len(rollouts) == 12  # every sample made, by the endpoint left
        assert engine.regenerated >= 2 and engine.regenerated % 2 == 0
        assert "ConnectError" in engine.endpoints[0].last_error
        spare.kill()
        spare.wait()
        with pytest.raises(EngineUnavailable, match="down|no rollout endpoint"):
            engine.generate(requests_for(tokenizer), params)
    finally:
        for p in (process, spare):
            p.kill()
            p.wait()


def test_a_bad_request_is_not_retried(servers, tokenizer):
    engine = OpenAIEngine(servers, tokenizer)
    bad = httpx.post(f"{servers[0]}/v1/completions", json={"prompt": [], "n": 1})
    assert bad.status_code == 400 and "prompt" in bad.text
    engine.model = "whatever"  # accepted: honing's server serves one model under any name
    request = GenerationRequest("p", [1] * 70, 0)
    with pytest.raises(ValueError, match="max_seq_len"):
        engine.generate([request], SamplingParams(max_seq_len=64))
    engine.close()
    with pytest.raises(EngineRequestError, match="token_id"):
        from honing.rollout.remote.engine import _token_id

        _token_id("hello")


def on_servers(servers, mode: str) -> dict:
    """Overrides for a 3-step run that samples from ``servers`` under schedule ``mode``
    (``async-partial``: async with partial rollouts, chunks of 2 tokens)."""
    partial = {
        "schedule.partial_rollout": True,
        "schedule.partial_chunk_tokens": 2,
        "schedule.max_staleness": 2,
    }
    return {
        "rollout.engine": "openai",
        "rollout.endpoints": ",".join(servers),
        "schedule.mode": mode.removesuffix("-partial"),
        "trainer.total_steps": 3,
        "trainer.val_at_start": False,
    } | (partial if mode.endswith("-partial") else {})


@pytest.mark.parametrize("mode", ["sync", "async", "async-partial"])
def test_training_samples_from_the_servers_and_sends_them_each_version(
    servers, micro_model_dir, digit_reward, tmp_path, mode, run_config
):

    from honing.backends.launch import train

    cfg = run_config(micro_model_dir, digit_reward, **on_servers(servers, mode))
    train(cfg, tmp_path / "run", log=lambda message: None)
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    metrics = [m for m in map(json.loads, lines) if m["step"] >= 1]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        assert (
            m["samples/generated"]
            == m["samples/trained"]
            + m["samples/filtered"]
            + m["samples/failed"]
            + m["samples/stale"]
        )
    versions = {httpx.get(f"{url}/health").json()["weight_version"] for url in servers}
    # sync sends every version after its update; async the one step 3 was sampled with
    # (partial: the newest published while its chunks ran)
    if mode == "sync":
        assert versions == {3}
    else:
        assert len(versions) == 1 and versions <= {0, 1, 2}


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_killing_one_of_two_engines_mid_run_loses_no_sample(
    micro_model_dir, digit_reward, tmp_path, mode, run_config
):
    """The run goes on with the engine left; the samples of the request the dying engine
    never answered are generated again and counted (samples/regenerated); the invariant
    holds at every step. The victim dies on its 7th completion request (mid-step 3 or 4)."""
    from honing.backends.launch import train

    victim, victim_url = start_service(
        "rollout", "--model", str(micro_model_dir), "--exit-after", "7"
    )
    spare, spare_url = start_service("rollout", "--model", str(micro_model_dir))
    metrics_path = tmp_path / "run" / "metrics.jsonl"
    try:
        cfg = run_config(
            micro_model_dir,
            digit_reward,
            **{
                "rollout.batch_size": 4,
                "rollout.engine": "openai",
                "rollout.endpoints": f"{victim_url},{spare_url}",
                "rollout.max_concurrency": 4,
                "schedule.mode": mode,
                "trainer.total_steps": 6,
                "trainer.val_at_start": False,
            },
        )
        train(cfg, tmp_path / "run", log=lambda message: None)
    finally:
        for process in (victim, spare):
            process.kill()
            process.wait()
    assert victim.returncode == 17  # it died mid-run, as told
    metrics = [m for m in map(json.loads, metrics_path.read_text().splitlines()) if m["step"]]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    for m in metrics:
        parts = ("samples/trained", "samples/filtered", "samples/failed", "samples/stale")
        assert m["samples/generated"] == sum(m[k] for k in parts) == 12
    lost = sum(m["samples/regenerated"] for m in metrics)
    assert lost >= 3 and lost % 3 == 0  # the groups it never answered (one, or two in flight)


def test_the_acceptance_a_speculating_server_reports_is_recorded(micro_model_dir, tokenizer):
    """rollout.speculative=server: the engine reads vLLM's spec-decode counters at /metrics
    (honing's server exposes the same when it speculates) and reports the acceptance of the
    calls since the last report."""
    process, url = start_service(
        "rollout", "--model", str(micro_model_dir), "--speculative", "ngram", "--spec-tokens", "3"
    )
    try:
        engine = OpenAIEngine([url], tokenizer, spec_metrics=True)
        assert engine.take_report() == ({}, [])  # nothing generated yet
        engine.generate(requests_for(tokenizer), SamplingParams(n=4, max_new_tokens=8, seed=1))
        metrics, _ = engine.take_report()
        counters = _counters(httpx.get(f"{url}/metrics").text)
        assert counters["draft_tokens"] > 0 and counters["drafts"] > 0
        want = counters["accepted_tokens"] / counters["draft_tokens"]
        assert metrics["rollout/spec_accept_rate"] == pytest.approx(want)
        assert engine.take_report() == ({}, [])  # the next report covers only later calls
    finally:
        process.kill()
        process.wait()


def test_vllm_counters_are_summed_over_their_labels():
    page = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 5.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 45.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 30.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="0"} 12.0
vllm:num_requests_running{model_name="m"} 1.0
"""
    assert _counters(page) == {"drafts": 15.0, "draft_tokens": 45.0, "accepted_tokens": 30.0}


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_lora_run_sends_the_servers_its_policy_merged(
    servers, micro_model_dir, digit_reward, tmp_path, mode, run_config, tokenizer, model
):
    """The servers hold the plain model: they get the adapters merged into the base weights,
    and sample with the logprobs of the checkpointed adapters of the version they hold."""
    peft = pytest.importorskip("peft")
    from honing.backends.launch import train

    lora = {"model.lora_rank": 4, "trainer.lr": 5e-2, "checkpoint.every": 1, "checkpoint.keep": 3}
    cfg = run_config(micro_model_dir, digit_reward, **on_servers(servers, mode) | lora)
    train(cfg, tmp_path / "run", log=lambda message: None)
    (version,) = {httpx.get(f"{url}/health").json()["weight_version"] for url in servers}
    # sync sends every version after its update; async the one step 3 was sampled with
    assert version == 3 if mode == "sync" else version in (1, 2)
    checkpoint = tmp_path / "run" / "checkpoints" / f"step_{version}"
    base = load_causal_lm(micro_model_dir, tokenizer, dtype="float32", device=CPU)
    trained = peft.PeftModel.from_pretrained(base, checkpoint).eval()
    engine = OpenAIEngine(servers, tokenizer)
    params = SamplingParams(n=4, max_new_tokens=5, max_seq_len=64, seed=3)
    moved = 0.0
    for r in engine.generate(requests_for(tokenizer), params):
        got = torch.tensor(r.behaviour_logprobs)
        want = teacher_forced_logprobs(trained, r.prompt_ids, r.response_ids)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        moved = max(
            moved,
            (got - teacher_forced_logprobs(model, r.prompt_ids, r.response_ids)).abs().max().item(),
        )
    assert moved > 1e-3  # the adapters trained: not the base model's logprobs
    engine.load_weights(0, [list(model.state_dict().items())])  # back, for the others
    engine.close()


class SGLangWire:
    """An HTTP server on loopback that answers like SGLang's with
    ``--enable-return-routed-experts``, in front of a ``honing serve rollout``: its
    completions carry the first choice's routed experts once per response, as base64 int32
    bytes in ``sglext.routed_experts``, one row longer than the tokens that feed training
    (SGLang also runs the last token). Every completion request's body is kept."""

    def __init__(self, upstream: str):
        import http.server
        import threading

        self.upstream, self.bodies = upstream, []
        wire = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                self._relay(None)

            def do_POST(self):
                self._relay(self.rfile.read(int(self.headers.get("Content-Length", 0))))

            def _relay(self, body):
                headers = {"Content-Type": self.headers.get("Content-Type", "application/json")}
                answer = httpx.request(
                    self.command, wire.upstream + self.path, content=body, headers=headers
                )
                content = answer.content
                if self.path == "/v1/completions" and answer.status_code == 200:
                    content = wire.as_sglang(json.loads(body), answer.json())
                self.send_response(answer.status_code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(content)))
                self.end_headers()
                self.wfile.write(content)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def as_sglang(self, request: dict, answer: dict) -> bytes:
        import base64

        self.bodies.append(request)
        prompt = answer.pop("prompt_routed_experts", None)
        routes = [choice.pop("routed_experts", None) for choice in answer["choices"]]
        if request.get("return_routed_experts") and prompt is not None:
            rows = prompt + routes[0]
            rows = rows + rows[-1:]  # the last token's row, which feeds no training position
            flat = torch.tensor(rows, dtype=torch.int32).numpy().tobytes()
            answer["sglext"] = {"routed_experts": base64.b64encode(flat).decode()}
        return json.dumps(answer).encode()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_a_server_returns_its_mixture_of_experts_routing_for_replay(
    moe_dirs, digit_reward, tmp_path, run_config
):
    """``honing serve rollout`` of an MoE policy answers with vLLM's routed-experts fields,
    and a server speaking SGLang's form (base64, first choice only) is read too: the engine
    asks it for one sample per request. Either way an R3 run replays the server's experts
    (the trainer's live routers agree with them at the weights it sampled with)."""
    from honing.backends.launch import train
    from honing.rollout.remote.routed_experts import RoutingShape

    process, url = start_service("rollout", "--model", str(moe_dirs["qwen3_moe"]))
    sglang = SGLangWire(url)
    try:
        answer = httpx.post(
            f"{url}/v1/completions", json={"prompt": [[5, 6, 7]], "n": 2, "max_tokens": 3}
        ).json()
        assert len(answer["prompt_routed_experts"]) == 3  # [prompt tokens, layers, top_k]
        assert all(len(c["routed_experts"]) == len(c["token_ids"]) - 1 for c in answer["choices"])
        # both forms read to the same experts (greedy: the samples are the same)
        shape = RoutingShape(moe_layers=(0, 2), num_layers=3, top_k=2)  # layer 1 is dense
        tokenizer = load_tokenizer(moe_dirs["qwen3_moe"])
        greedy = SamplingParams(n=2, max_new_tokens=4, greedy=True, max_seq_len=64)
        read = []
        for server in (url, sglang.url):
            engine = OpenAIEngine([server], tokenizer, routing=shape)
            read.append(engine.generate(requests_for(tokenizer), greedy))
            engine.close()
        for vllm_form, sglang_form in zip(*read, strict=True):
            assert vllm_form.response_ids == sglang_form.response_ids
            assert vllm_form.routed_experts is not None
            assert torch.equal(vllm_form.routed_experts, sglang_form.routed_experts)
        for name, server in (("vllm", url), ("sglang", sglang.url)):
            values = on_servers([server], "sync") | {"algorithm.routing_replay": "R3"}
            cfg = run_config(
                moe_dirs["qwen3_moe"], digit_reward, **values | {"trainer.total_steps": 2}
            )
            train(cfg, tmp_path / name, log=lambda message: None)
    finally:
        sglang.close()
        process.kill()
        process.wait()
    for name in ("vllm", "sglang"):
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        steps = [m for m in map(json.loads, lines) if "actor/pg_loss" in m]
        assert len(steps) == 2 and all(m["moe/rollout_router_match"] >= 0.99 for m in steps)
    assert all(body["return_routed_experts"] for body in sglang.bodies)
    # the first groups (sent at once) came back routed for their first choice only; from
    # then on each sample went in a request of its own
    groups = [i for i, body in enumerate(sglang.bodies) if body["n"] > 1]
    singles = sglang.bodies[groups[-1] + 1 :]
    assert groups and len(singles) > 2 * len(groups) and all(b["n"] == 1 for b in singles)


def test_sglang_bytes_that_list_dense_layers_keep_the_moe_layers_rows():
    """A server whose bytes give every decoder layer (dense ones as -1) is read down to the
    MoE layers; bytes that fit neither shape are no routing at all."""
    import base64

    from honing.rollout.remote.routed_experts import RoutingShape, sglang_experts

    shape = RoutingShape(moe_layers=(1, 3), num_layers=4, top_k=2)
    rows = torch.arange(3 * 4 * 2, dtype=torch.int32).reshape(3, 4, 2)
    rows[:, [0, 2]] = -1
    flat = base64.b64encode(rows.numpy().tobytes()).decode()
    assert torch.equal(sglang_experts(shape, flat, 3), rows[:, [1, 3]].to(torch.int16))
    assert torch.equal(sglang_experts(shape, flat, 2), rows[:2, [1, 3]].to(torch.int16))
    assert sglang_experts(shape, flat, 4) is None
    # 2 rows of every layer and 3 rows of the MoE layers have the same size: the dense
    # layer's values (not -1) say which one the bytes are
    shape = RoutingShape(moe_layers=(0, 1), num_layers=3, top_k=2)
    moe_rows = torch.arange(3 * 2 * 2, dtype=torch.int32).reshape(3, 2, 2)
    flat = base64.b64encode(moe_rows.numpy().tobytes()).decode()
    assert torch.equal(sglang_experts(shape, flat, 2), moe_rows[:2].to(torch.int16))


def test_losing_every_server_in_a_sync_or_a_generation_ends_the_run_in_one_line(
    micro_model_dir, digit_reward, tokenizer, tmp_path, monkeypatch, capsys
):
    """The only server dies while a run sends it new weights: ``honing train`` ends with one
    line naming it (exit status 2); a request for samples it can no longer answer is the same
    kind of error (a ``UserError``, one line)."""
    from pipeline._configs import cli_args

    import honing.pipeline.weight_sync as weight_sync
    from honing.cli import main as honing_main

    process, url = process_start_service("rollout", "--model", str(micro_model_dir))
    sampler = OpenAIEngine([url], tokenizer, cooldown_s=60, weight_sync="none")
    made = weight_sync.rollout_weights

    def dying_midway(parts, engine):
        for index, bucket in enumerate(made(parts, engine)):
            if index == 0:
                process.kill()
                process.wait()
            yield bucket

    monkeypatch.setattr(weight_sync, "rollout_weights", dying_midway)
    overrides = {
        "rollout.engine": "openai",
        "rollout.endpoints": url,
        "rollout.batch_size": 1,
        "trainer.total_steps": 2,
        "trainer.val_at_start": False,
    }
    args = cli_args(micro_model_dir, digit_reward, tmp_path / "run", **overrides)
    try:
        assert honing_main(["train", *args]) == 2
    finally:
        process.kill()
        process.wait()
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and url in lines[0] and "new weights" in lines[0], lines
    with pytest.raises(UserError) as lost:
        sampler.generate(requests_for(tokenizer), SamplingParams(n=1, max_new_tokens=2))
    assert url in str(lost.value) and "\n" not in str(lost.value)
    sampler.close()


def test_a_policy_without_a_layer_of_the_served_model_is_refused_at_its_first_sync(
    micro_model_dir, tokenizer, model, tmp_path
):
    """A server holds a 3-layer model and the policy has 2 layers of the same sizes, named
    in ``rollout.model_name`` (every tensor it sends is a name and shape the server has): the
    first sync (tensors or disk) is refused in one line naming a weight it lacks, and the
    server keeps its weights and version (it would have sampled from its own third layer over
    the policy's two)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(micro_model_dir)
    config.num_hidden_layers = 3
    deeper = tmp_path / "deeper"
    AutoModelForCausalLM.from_config(config).save_pretrained(deeper)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (deeper / name).write_bytes((micro_model_dir / name).read_bytes())
    process, url = start_service("rollout", "--model", str(deeper))
    body = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}
    before = httpx.post(f"{url}/v1/completions", json=body).json()["choices"]
    served = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    try:
        for sync in ("tensors", "disk"):
            engine = OpenAIEngine(
                [url], tokenizer, model=served, weight_sync=sync, weight_dir=str(tmp_path / "w")
            )
            with pytest.raises(UserError) as refused:
                engine.load_weights(1, [list(model.state_dict().items())])
            engine.close()
            message = str(refused.value)
            assert url in message and "\n" not in message
            assert "lacks 9 of the served model's 29 weights (first: model.layers.2." in message
            assert httpx.get(f"{url}/health").json()["weight_version"] == 0
            assert httpx.post(f"{url}/v1/completions", json=body).json()["choices"] == before
    finally:
        process.kill()
        process.wait()


def test_a_server_takes_weights_from_one_trainer_at_a_time(servers, tokenizer, model):
    """Two trainers on one server: the first to send weights holds it; the second's sync
    (and an update sent by hand) is refused in one line and changes nothing; once the first
    closes, the second may send."""
    url = servers[0]
    original = [list(model.state_dict().items())]
    first, second = (OpenAIEngine([url], tokenizer) for _ in "12")
    first.load_weights(1, original)
    with pytest.raises(UserError) as refused:
        second.load_weights(2, original)
    message = str(refused.value)
    assert url in message and "one trainer at a time" in message and "\n" not in message
    assert first.trainer in message
    assert httpx.post(f"{url}/update_weights/hold").status_code == 409  # no trainer named
    assert httpx.get(f"{url}/health").json()["weight_version"] == 1
    first.close()
    second.load_weights(0, original)
    assert httpx.get(f"{url}/health").json()["weight_version"] == 0
    second.close()


def test_a_full_disk_in_a_disk_sync_is_one_line_and_the_servers_keep_their_weights(
    servers, tokenizer, model, tmp_path, monkeypatch
):
    """``rollout.weight_sync=disk`` cannot write its second shard: one line naming the
    directory and the cause, nothing half-written left, every bucket still read (a sharded
    trainer's ranks gather them together), and the servers keep their weights."""
    import safetensors.torch

    written = []

    def full_after_one(tensors, path):
        if written:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written.append(path)

    read = []

    def weights():
        items = list(model.state_dict().items())
        for index in range(0, len(items), 5):
            read.append(index)
            yield items[index : index + 5]

    weight_dir = tmp_path / "weights"
    engine = OpenAIEngine(
        servers,
        tokenizer,
        weight_sync="disk",
        weight_dir=str(weight_dir),
        model_dir=model.name_or_path,
    )
    monkeypatch.setattr(safetensors.torch, "save_file", full_after_one)
    with pytest.raises(UserError) as failed:
        engine.load_weights(3, weights())
    engine.close()
    message = str(failed.value)
    assert f"{weight_dir} (No space left on device)" in message and "\n" not in message
    assert len(read) == len(range(0, len(model.state_dict()), 5))
    assert list(weight_dir.iterdir()) == []
    assert {httpx.get(f"{url}/health").json()["weight_version"] for url in servers} == {0}
