"""Weights streamed bucket by bucket from the trainer's side to ``honing serve rollout``
processes on loopback (``OpenAIEngine``, ``rollout.weight_sync=tensors|disk``): what a sync
holds in memory, a server that comes back after a failure, and tied weights sent once."""

import re
import subprocess
import time
import tracemalloc
from functools import partial

import httpx
import pytest
import torch

from honing.data import warmstart_corpus
from honing.models.loading import load_causal_lm, load_tokenizer
from honing.models.tiny import TinySpec, build_tiny_model
from honing.rollout.base import GenerationRequest, SamplingParams, WeightStream
from honing.rollout.remote.engine import EngineRequestError, OpenAIEngine
from honing.rollout.remote.senders import _Untied
from honing.trainer.engine import buckets
from tests.warm import honing, start_service

CPU = torch.device("cpu")
BUCKET = 2 << 20


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory):
    """A Llama of ~28 MB of float32 weights in matrices of 1 MB (four layers of width 512,
    its embedding tied to its head), with the built-in tokenizer; one warm-start step."""
    spec = TinySpec(
        hidden_size=512,
        num_layers=4,
        num_heads=8,
        intermediate_size=512,
        warmstart_steps=1,
        warmstart_batch=2,
    )
    corpus = warmstart_corpus(4, 0, 2, 0.6)
    return build_tiny_model(tmp_path_factory.mktemp("wide"), corpus, spec, log=lambda m: None)


def _status_kb(key: str) -> int:
    return int(re.search(rf"{key}:\s+(\d+) kB", open("/proc/self/status").read()).group(1))


def _peaks(sync) -> tuple[int, int]:
    """The most bytes ``sync()`` held at once beyond what was held before it: (in Python
    objects, by tracemalloc; in the process's resident memory, every allocator, from the
    kernel's high-water mark)."""
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # the high-water mark starts again from the resident size
    resident = _status_kb("VmRSS")
    tracemalloc.start()
    try:
        sync()
        python = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return python, (_status_kb("VmHWM") - resident) << 10


def _moved(model, scale: float) -> None:
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(scale)


@pytest.mark.slow
def test_a_sync_holds_about_two_buckets_not_the_model(wide_model_dir, tmp_path):
    """Syncing a 28 MB model in 2 MB buckets to a real server (tensors: a request per
    bucket; disk: a shard per bucket) holds one bucket's copy and body at a time. Measured
    beyond what was held before the sync (the trainer's weights): the peak of Python objects
    (tracemalloc: request bodies) stays near one bucket, and the peak resident memory (every
    allocator: torch, safetensors' buffers), once a first sync warmed the allocator, within
    a few buckets; one request body of the whole model held over 28 MB in either."""
    tokenizer = load_tokenizer(wide_model_dir)
    model = load_causal_lm(wide_model_dir, tokenizer, dtype="float32", device=CPU)
    model_bytes = sum(t.numel() * t.element_size() for t in model.parameters())
    assert 20 << 20 < model_bytes < 40 << 20
    process, url = start_service("rollout", "--model", str(wide_model_dir))
    try:
        for sync in ("tensors", "disk"):
            engine = OpenAIEngine(
                [url],
                tokenizer,
                weight_sync=sync,
                weight_dir=str(tmp_path / "weights"),
                model_dir=str(wide_model_dir),
            )
            peaks = []
            for version in (1, 2):  # the first warms the client up; the second is measured
                _moved(model, 0.01)
                weights = buckets(model.state_dict().items(), BUCKET)
                peaks.append(_peaks(partial(engine.load_weights, version, weights)))
            engine.close()
            health = httpx.get(f"{url}/health").json()
            assert health["weight_version"] == 2, sync
            for name, (python, resident) in zip(("first", "second"), peaks, strict=True):
                print(
                    f"{sync}, {name} sync: {model_bytes / 2**20:.1f} MB in {BUCKET >> 20} MB"
                    f" buckets; peak extra {python / 2**20:.2f} MB in Python objects,"
                    f" {resident / 2**20:.2f} MB resident"
                )
            python, resident = peaks[1]
            assert python < 2.5 * BUCKET, sync
            assert resident < 4 * BUCKET, sync
        shards = sorted(p.name for p in (tmp_path / "weights" / "v2").glob("*.safetensors"))
        assert len(shards) >= model_bytes // BUCKET  # a shard per bucket, and their index
        assert (tmp_path / "weights" / "v2" / "model.safetensors.index.json").exists()
    finally:
        process.kill()
        process.wait()


def _kill(process: subprocess.Popen) -> None:
    process.kill()
    process.wait()


def _restart(url: str, model_dir) -> subprocess.Popen:
    """``honing serve rollout`` started again at ``url`` (its port): a server back from a
    crash, holding the weights it starts with (version 0)."""
    port = url.rsplit(":", 1)[1]
    command = [*honing(), "serve", "rollout", "--model", str(model_dir), "--port", port]
    process = subprocess.Popen(command, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return process
        except httpx.HTTPError:
            time.sleep(0.1)
    process.kill()
    raise AssertionError(f"the server at {url} did not come back")


@pytest.mark.slow
def test_a_server_that_comes_back_is_sent_the_weights_again(micro_model_dir, tmp_path):
    """The engine keeps no copy of the weights: a server that was down when they were sent
    and comes back with its own is sent them again, made by ``WeightStream.again``, before it
    serves; without ``again`` it serves nothing until the next sync brings it up to date."""
    tokenizer = load_tokenizer(micro_model_dir)
    model = load_causal_lm(micro_model_dir, tokenizer, dtype="float32", device=CPU)
    _moved(model, 0.05)
    prompt = tokenizer("12+34=", add_special_tokens=False)["input_ids"]
    requests = [GenerationRequest(f"p{i}", prompt, i) for i in range(4)]
    greedy = SamplingParams(n=1, max_new_tokens=4, max_seq_len=64, greedy=True)

    def weights():
        return buckets(model.state_dict().items(), 4 << 10)

    (victim, victim_url), (spare, spare_url) = (
        start_service("rollout", "--model", str(micro_model_dir)) for _ in range(2)
    )
    engine = OpenAIEngine([victim_url, spare_url], tokenizer, cooldown_s=0.2)
    try:
        _kill(victim)
        engine.load_weights(1, WeightStream(weights(), again=weights))
        assert engine.endpoints[0].failures == 1  # down: set aside
        victim = _restart(victim_url, micro_model_dir)
        assert httpx.get(f"{victim_url}/health").json()["weight_version"] == 0
        time.sleep(0.3)  # its cool-down over, it is tried again
        rollouts = engine.generate(requests, greedy)
        assert {r.weight_version for r in rollouts} == {1}
        assert httpx.get(f"{victim_url}/health").json()["weight_version"] == 1
        answers = [
            httpx.post(
                f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 4}, timeout=30
            ).json()["choices"][0]["token_ids"]
            for url in (victim_url, spare_url)
        ]
        assert answers[0] == answers[1]  # the same weights on both

        _kill(victim)
        engine.load_weights(2, weights())  # no way to make them again
        victim = _restart(victim_url, micro_model_dir)
        time.sleep(0.3)
        rollouts = engine.generate(requests, greedy)
        assert {r.weight_version for r in rollouts} == {2}  # the spare alone
        assert httpx.get(f"{victim_url}/health").json()["weight_version"] == 0
        engine.load_weights(3, weights())
        assert httpx.get(f"{victim_url}/health").json()["weight_version"] == 3
    finally:
        engine.close()
        for process in (victim, spare):
            _kill(process)


@pytest.mark.slow
def test_a_bucket_a_server_refuses_leaves_every_server_as_it_was(micro_model_dir):
    """A bucket that does not fit the served model is refused: the update is committed
    nowhere (both servers keep their version and their answers), the refusal is raised with
    the server's message, and every bucket is still read (a sharded trainer's ranks gather
    them together)."""
    tokenizer = load_tokenizer(micro_model_dir)
    model = load_causal_lm(micro_model_dir, tokenizer, dtype="float32", device=CPU)
    _moved(model, 0.05)
    pieces = list(model.state_dict().items())
    read = []

    def weights():
        for index, bucket in enumerate([pieces[:3], [("model.norm.weight", torch.ones(33))]]):
            read.append(index)
            yield bucket
        read.append(2)
        yield pieces[3:]

    started = [start_service("rollout", "--model", str(micro_model_dir)) for _ in range(2)]
    urls = [url for _, url in started]
    body = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}
    before = [httpx.post(f"{url}/v1/completions", json=body).json()["choices"] for url in urls]
    engine = OpenAIEngine(urls, tokenizer)
    try:
        with pytest.raises(EngineRequestError, match="model.norm.weight has shape"):
            engine.load_weights(1, weights())
        assert read == [0, 1, 2]
        for url, choices in zip(urls, before, strict=True):
            assert httpx.get(f"{url}/health").json()["weight_version"] == 0
            assert httpx.post(f"{url}/v1/completions", json=body).json()["choices"] == choices
    finally:
        engine.close()
        for process, _ in started:
            _kill(process)


def test_tied_weights_go_once_and_reused_memory_is_no_tie():
    """A tensor that shares a storage already sent in the update (an embedding tied to the
    head) is left out; one made for the stream in the memory a freed one had (the allocator
    reuses it) is still sent."""
    untied = _Untied()
    embedding = torch.randn(4, 3)
    tied = [("embed.weight", embedding), ("head.weight", embedding), ("norm", torch.ones(3))]
    assert list(untied.tensors(tied)) == ["embed.weight", "norm"]

    def made_one_at_a_time():  # as merged LoRA matrices or gathered shards come
        for index in range(16):
            yield [(f"w{index}", torch.full((256,), float(index)))]

    sent = {}
    for bucket in made_one_at_a_time():
        sent |= {name: float(tensor[0]) for name, tensor in untied.tensors(bucket).items()}
        del bucket
    assert sent == {f"w{index}": float(index) for index in range(16)}


def test_a_vocabulary_the_served_model_lacks_is_refused_saying_why():
    """honing gives a tokenizer without a pad token one (the embeddings grow a row); a
    server started from the original directory holds one row fewer: the refusal says so and
    what to serve instead. Other shape differences get no such hint."""
    from honing.rollout.vllm.weights import WONT_FIT, check_pieces

    served = {"model.embed_tokens.weight": (32768, 256), "model.norm.weight": (256,)}
    grown = [("model.embed_tokens.weight", torch.zeros(32769, 256))]
    with pytest.raises(ValueError, match=WONT_FIT) as refused:
        check_pieces(grown, served, tied=True)
    assert "1 more row(s): honing adds a pad token" in str(refused.value)
    with pytest.raises(ValueError) as other:
        check_pieces([("model.norm.weight", torch.zeros(128))], served, tied=True)
    assert "pad token" not in str(other.value)
