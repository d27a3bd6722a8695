"""vLLM servers behind ``rollout.engine=openai``: a real vLLM server (PyPI's build for CPUs) on
loopback, new weights through its RL API (``rollout.weight_sync=vllm``, honing's shared-memory
backend), and the start-up checks of its launch flags.

One server at a time: started once for the module (~25 s) and restarted once, by the test that
kills it."""

import errno
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch

pytest.importorskip("vllm")

from honing.cli import main as honing_main  # noqa: E402
from honing.errors import ConfigError, UserError  # noqa: E402
from honing.models.loading import load_causal_lm, load_tokenizer  # noqa: E402
from honing.pipeline.partial import PartialPool  # noqa: E402
from honing.rollout.base import GenerationRequest, SamplingParams, WeightStream  # noqa: E402
from honing.rollout.remote import vllm_sender  # noqa: E402
from honing.rollout.remote.engine import EngineUnavailable, OpenAIEngine  # noqa: E402
from honing.rollout.vllm.weights import write_bucket  # noqa: E402
from honing.services.process import free_port  # noqa: E402
from honing.types import Prompt  # noqa: E402

pytestmark = pytest.mark.slow

CPU = torch.device("cpu")
PROMPTS = ["12+34=", "7+8=", "55+45="]
# fp32 on both sides, but vLLM's CPU kernels (oneDNN GEMMs, its paged attention) sum in other
# orders than torch's: the sampled tokens' logprobs differ by 1e-6 to 1e-5 here. 1e-4 leaves
# room for other CPUs' kernels; the stale output head this guards against moved them by up
# to 1.2 nats.
LOGPROB_ATOL = 1e-4


class Server:
    """``python -m vllm.entrypoints.openai.api_server`` on a loopback port, in a process group
    of its own: its API server, engine core and worker are killed together."""

    def __init__(self, model_dir: Path, log: Path) -> None:
        self.model_dir, self.log = model_dir, log
        self.url = f"http://127.0.0.1:{free_port()}"
        self.process: subprocess.Popen | None = None

    def start(self, logprobs_mode: str = "processed_logprobs", timeout_s: float = 240.0):
        argv = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--host",
            "127.0.0.1",
            "--port",
            self.url.rsplit(":", 1)[1],
            "--dtype",
            "float32",
            "--enforce-eager",
            "--max-model-len",
            "64",
            "--kv-cache-memory-bytes",
            str(16 << 20),
            "--logprobs-mode",
            logprobs_mode,
            "--weight-transfer-config",
            '{"backend": "honing"}',
        ]
        env = os.environ | {"VLLM_SERVER_DEV_MODE": "1"}
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vLLM exited: {self.log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.kill()
        raise RuntimeError(f"vLLM did not answer in {timeout_s} s: {self.log.read_text()[-3000:]}")

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        if self.process is not None:
            self.process.wait()

    def weight_version(self) -> str:
        return httpx.get(f"{self.url}/weight_info").json()["weight_version"]

    def is_paused(self) -> bool:
        return httpx.get(f"{self.url}/is_paused").json()["is_paused"]


@pytest.fixture(scope="module")
def server(vllm_model_dir, tmp_path_factory):
    started = Server(vllm_model_dir, tmp_path_factory.mktemp("vllm") / "server.log")
    started.start()
    yield started
    started.kill()


@pytest.fixture(scope="module")
def tokenizer(vllm_model_dir):
    return load_tokenizer(vllm_model_dir)


def policy(model_dir: Path, tokenizer):
    return load_causal_lm(model_dir, tokenizer, dtype="float32", device=CPU).eval()


def engine_on(server: Server, tokenizer, weight_sync: str, **settings) -> OpenAIEngine:
    """An ``OpenAIEngine`` on ``server`` (the policy is the served model)."""
    model_dir = str(server.model_dir)
    return OpenAIEngine(
        [server.url], tokenizer, weight_sync=weight_sync, model_dir=model_dir, **settings
    )


def requests_for(tokenizer) -> list[GenerationRequest]:
    return [
        GenerationRequest(f"p{i}", tokenizer(text, add_special_tokens=False)["input_ids"], i)
        for i, text in enumerate(PROMPTS)
    ]


def buckets(model) -> list[list]:
    """The model's state in buckets of five tensors: a layer's weights come in two."""
    items = list(model.state_dict().items())
    return [items[i : i + 5] for i in range(0, len(items), 5)]


def perturbed(model, seed: int):
    torch.manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():  # tied embeddings stay tied
            parameter.add_(0.3 * torch.randn_like(parameter))
    return model


def teacher_forced(model, prompt_ids: list[int], response_ids: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt_ids + response_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1]
    return logits.log_softmax(-1).gather(-1, torch.tensor(response_ids)[:, None]).squeeze(-1)


def greedy(model, prompt_ids: list[int], steps: int, stop_ids: set[int]) -> list[int]:
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            if ids[-1] in stop_ids:
                break
    return ids[len(prompt_ids) :]


def assert_samples_from(engine: OpenAIEngine, model, tokenizer, seed: int) -> None:
    """Sampled tokens carry ``model``'s logprobs; greedy tokens are ``model``'s."""
    sampling = SamplingParams(n=4, max_new_tokens=6, max_seq_len=64, seed=seed)
    for rollout in engine.generate(requests_for(tokenizer), sampling):
        want = teacher_forced(model, rollout.prompt_ids, rollout.response_ids)
        got = torch.tensor(rollout.behaviour_logprobs)
        torch.testing.assert_close(got, want, atol=LOGPROB_ATOL, rtol=0)
    argmax = SamplingParams(n=1, max_new_tokens=6, max_seq_len=64, greedy=True)
    for rollout in engine.generate(requests_for(tokenizer), argmax):
        assert rollout.response_ids == greedy(model, rollout.prompt_ids, 6, engine.stop_ids)


def test_weights_through_the_rl_api_give_the_trainers_logprobs(
    server, vllm_model_dir, tokenizer, tmp_path
):
    local = policy(vllm_model_dir, tokenizer)
    engine = engine_on(server, tokenizer, "vllm", weight_dir=str(tmp_path))
    for version in (1, 2, 3):
        engine.load_weights(version, buckets(perturbed(local, seed=version)))
        assert server.weight_version() == str(version)
        assert list(tmp_path.iterdir()) == []  # each bucket file deleted once loaded
        assert_samples_from(engine, local, tokenizer, seed=version)
    engine.load_weights(0, buckets(policy(vllm_model_dir, tokenizer)))  # back, for the other tests
    engine.close()


def test_a_server_left_paused_is_refused_at_once(server, tokenizer):
    """A trainer that stopped in the middle of a sync leaves the server paused: every request
    would wait on it, so the start-up check refuses it before any."""
    httpx.post(f"{server.url}/pause", params={"mode": "keep"}, timeout=30).raise_for_status()
    try:
        with pytest.raises(ConfigError, match="is paused"):
            engine_on(server, tokenizer, "vllm")
    finally:
        httpx.post(f"{server.url}/resume", timeout=30).raise_for_status()


def test_training_samples_from_the_server_and_sends_it_each_version(
    server, vllm_model_dir, digit_reward, tmp_path, run_config
):
    from honing.backends.launch import train

    overrides = {
        "rollout.engine": "openai",
        "rollout.endpoints": server.url,
        "rollout.weight_sync": "vllm",
        "trainer.total_steps": 3,
        "trainer.val_at_start": False,
    }
    config = run_config(vllm_model_dir, digit_reward, **overrides)
    train(config, tmp_path / "run", log=lambda message: None)
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    metrics = [m for m in map(json.loads, lines) if m["step"] >= 1]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        parts = ("samples/trained", "samples/filtered", "samples/failed", "samples/stale")
        assert m["samples/generated"] == sum(m[k] for k in parts) > 0
        # the server sampled from the policy the trainer had: its weights arrived whole
        assert m["rollout_mismatch/logprob_diff_max"] < LOGPROB_ATOL
    assert server.weight_version() == "3"


def test_partial_samples_go_on_after_new_weights_with_each_tokens_logprob(
    server, vllm_model_dir, tokenizer, tmp_path
):
    """Partial rollouts against the server: two tokens per sample by the served weights,
    new weights through the RL API, and the samples go on in chunks of two: each token's
    logprob is its own version's (teacher forced here) and its version is recorded."""
    old = policy(vllm_model_dir, tokenizer)
    new = perturbed(policy(vllm_model_dir, tokenizer), seed=7)
    engine = engine_on(server, tokenizer, "vllm", weight_dir=str(tmp_path))
    requests = requests_for(tokenizer)
    parts = SimpleNamespace(
        engine=engine,
        tokenizer=tokenizer,
        prompt_ids={r.prompt_id: r.prompt_ids for r in requests},
        train_sampling=SamplingParams(n=4, max_new_tokens=8, max_seq_len=64, seed=1),
    )
    pool = PartialPool(parts, group_size=4, batch_size=3, chunk_tokens=2, max_staleness=2)
    pool.add([Prompt(r.prompt_id, "", "") for r in requests])
    engine.load_weights(0, buckets(old))  # an earlier test may have left it others
    try:
        pool.chunk(seed=5)
        engine.load_weights(1, buckets(new))
        while pool.ready() < 3:
            pool.chunk(seed=5)
    finally:
        engine.load_weights(0, buckets(policy(vllm_model_dir, tokenizer)))
        engine.close()  # the server lets go of this trainer
    spanned = 0
    for rollout in pool.rollouts(pool.take(), 1):
        versions = torch.tensor(rollout.token_versions())
        assert set(versions[:2].tolist()) == {0} and set(versions[2:].tolist()) <= {1}
        spanned += len(rollout.version_spans) > 1
        got = torch.tensor(rollout.behaviour_logprobs)
        for model, version in ((old, 0), (new, 1)):
            want = teacher_forced(model, rollout.prompt_ids, rollout.response_ids)
            at = versions == version
            torch.testing.assert_close(got[at], want[at], atol=LOGPROB_ATOL, rtol=0)
    assert spanned >= 1


def test_the_whole_stack_on_two_ranks_samples_from_the_server(
    server, vllm_model_dir, digit_reward, tmp_path
):
    """``honing train`` under torchrun, two gloo ranks with the policy sharded (FSDP), the
    async schedule with partial rollouts (chunks of 2 tokens, the weights gathered by both
    ranks at each step's end and sent to the server between chunks) and the calculator's
    turn loop, through the vLLM server: four steps, every sample accounted for. (Whether a
    sample spans two versions in a run depends on which side is faster; the test above
    makes one span.)"""
    from tests import warm
    from tests.pipeline._configs import cli_args

    overrides = {
        "rollout.engine": "openai",
        "rollout.endpoints": server.url,
        "rollout.weight_sync": "vllm",
        "rollout.max_new_tokens": 8,
        "rollout.tools": "[calculator]",
        "trainer.strategy": "fsdp",
        "trainer.threads": 1,
        "schedule.mode": "async",
        "schedule.max_staleness": 2,
        "schedule.partial_rollout": True,
        "schedule.partial_chunk_tokens": 2,
        "trainer.total_steps": 4,
        "trainer.val_at_start": False,
    }
    args = cli_args(vllm_model_dir, digit_reward, tmp_path / "run", **overrides)
    result = subprocess.run(
        warm.torchrun(2, "train", *args), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    metrics = [m for m in map(json.loads, lines) if m["step"] >= 1]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    for m in metrics:
        parts = ("samples/trained", "samples/filtered", "samples/failed", "samples/stale")
        assert m["samples/generated"] == sum(m[k] for k in parts) > 0
        assert "partial/carried_samples" in m  # sampled by the pool, in chunks
        assert m["dist/world_size"] == 2.0
    assert any("tool/turns_per_sample" in m for m in metrics)  # through the turn loop
    assert metrics[0]["rollout_mismatch/logprob_diff_max"] < LOGPROB_ATOL  # version 0 on both


def no_room_after(count: int):
    """The bucket writer of a directory that has room for ``count`` bucket files, then
    none (a full disk)."""
    written = itertools.count()

    def write(directory, name, tensors):
        if next(written) >= count:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write_bucket(directory, name, tensors)

    return write


def test_a_bucket_that_cannot_be_written_first_leaves_the_server_its_weights(
    server, vllm_model_dir, tokenizer, tmp_path, monkeypatch
):
    """No room for the first bucket's file, written before any server is paused: the sync
    ends in one line naming the directory and the cause, and the server serves on with the
    weights it had."""
    local = perturbed(policy(vllm_model_dir, tokenizer), seed=4)
    engine = engine_on(server, tokenizer, "vllm", weight_dir=str(tmp_path))
    engine.load_weights(4, buckets(local))
    monkeypatch.setattr(vllm_sender, "write_bucket", no_room_after(0))
    with pytest.raises(UserError) as failed:
        engine.load_weights(5, buckets(perturbed(policy(vllm_model_dir, tokenizer), seed=5)))
    message = str(failed.value)
    assert f"{tmp_path} (No space left on device)" in message, message
    assert "no server was touched" in message and "\n" not in message
    assert server.weight_version() == "4" and not server.is_paused()
    assert_samples_from(engine, local, tokenizer, seed=4)
    monkeypatch.undo()
    engine.load_weights(0, buckets(policy(vllm_model_dir, tokenizer)))  # back, for the others
    engine.close()


def test_a_sync_that_fails_half_way_leaves_no_layer_half_loaded(
    server, vllm_model_dir, tokenizer, tmp_path, monkeypatch
):
    """The disk fills after the first bucket: the update is abandoned, and every layer still
    waiting for tensors gets back its own. In buckets of three (the embedding, which vLLM
    pads and so processes at the end, and two of the first attention's three projections)
    no layer had come whole: the server is as before and serves on. In buckets of five the
    first attention's projections had come whole and stay new: the server is left paused,
    its version marked incomplete, the start-up check refuses it and the error line says to
    restart it; resumed by hand, it samples from exactly that mix (before, vLLM's engine died
    at the first request after a resume)."""
    old = policy(vllm_model_dir, tokenizer)
    new = perturbed(policy(vllm_model_dir, tokenizer), seed=11)
    items = list(new.state_dict().items())
    assert [name.split(".")[-2] for name, _ in items[:5]] == [
        "embed_tokens",
        *("q_proj", "k_proj", "v_proj", "o_proj"),
    ]
    engine = engine_on(server, tokenizer, "vllm", weight_dir=str(tmp_path))
    monkeypatch.setattr(vllm_sender, "write_bucket", no_room_after(1))
    with pytest.raises(UserError) as failed:
        engine.load_weights(1, [items[i : i + 3] for i in range(0, len(items), 3)])
    assert f"{tmp_path} (No space left on device)" in str(failed.value)
    assert f"{server.url} keeps version 0" in str(failed.value)
    assert server.weight_version() == "0" and not server.is_paused()
    assert_samples_from(engine, old, tokenizer, seed=6)

    read = []

    def in_fives():
        for index in range(0, len(items), 5):
            read.append(index)
            yield items[index : index + 5]

    monkeypatch.setattr(vllm_sender, "write_bucket", no_room_after(1))
    with pytest.raises(UserError) as failed:
        engine.load_weights(1, in_fives())
    assert read == list(range(0, len(items), 5))  # every bucket read: ranks gather together
    message = str(failed.value)
    assert f"{tmp_path} (No space left on device)" in message and "\n" not in message
    assert f"{server.url}: it holds part of version 1 over version 0" in message
    assert message.count("restart it") == 1 and list(tmp_path.iterdir()) == []
    assert server.is_paused() and server.weight_version().startswith("incomplete")
    monkeypatch.undo()
    httpx.post(f"{server.url}/resume", timeout=30).raise_for_status()
    with pytest.raises(ConfigError, match="holds part of one weight version over another"):
        engine_on(server, tokenizer, "vllm")
    mixed = policy(vllm_model_dir, tokenizer)
    with torch.no_grad():
        for name, tensor in items[1:5]:
            mixed.get_parameter(name).copy_(tensor)
    assert_samples_from(engine, mixed, tokenizer, seed=6)
    # back, for the others
    httpx.post(f"{server.url}/update_weight_version", json={"new_version": "0"}, timeout=30)
    engine.load_weights(0, buckets(old))
    engine.close()


def test_weights_that_do_not_fit_the_served_model_are_refused_in_one_line(
    server, vllm_model_dir, tokenizer, tmp_path
):
    """honing's backend checks each bucket against the checkpoint the server loaded before
    any of it loads: a tensor of another shape is refused and the server serves its weights
    on. An update that leaves out a layer the served model has (a policy with fewer layers,
    named in ``rollout.model_name``) is refused when the trainer confirms it, in one line
    naming the first tensor it lacks; vLLM has loaded the rest by then, so the server is
    marked and left paused."""
    old = policy(vllm_model_dir, tokenizer)
    items = list(old.state_dict().items())
    engine = engine_on(server, tokenizer, "vllm", weight_dir=str(tmp_path))
    wrong = [("model.norm.weight", torch.ones(33)), *items[:4]]
    with pytest.raises(UserError) as refused:
        engine.load_weights(1, [wrong, items[4:]])
    message = str(refused.value)
    assert "model.norm.weight has shape (33,); the served model's is (64,)" in message
    assert "it keeps version 0" in message and "\n" not in message
    assert server.weight_version() == "0" and not server.is_paused()

    fewer = [(name, tensor) for name, tensor in items if ".layers.1." not in name]
    with pytest.raises(UserError) as refused:
        engine.load_weights(1, [fewer[i : i + 5] for i in range(0, len(fewer), 5)])
    message = str(refused.value)
    assert "lacks vLLM's model.layers.1.input_layernorm.weight of the served" in message
    assert message.endswith("left paused: restart it") and "\n" not in message
    assert server.is_paused() and server.weight_version().startswith("incomplete")
    # back, for the others
    httpx.post(f"{server.url}/resume", timeout=30).raise_for_status()
    httpx.post(f"{server.url}/update_weight_version", json={"new_version": "0"}, timeout=30)
    engine.load_weights(0, buckets(old))
    engine.close()


def test_a_server_takes_weights_from_one_trainer_at_a_time(
    server, vllm_model_dir, tokenizer, tmp_path
):
    """Two trainers on one server: the first to send weights holds it (honing's backend
    keeps the hold); the second is refused in one line before it pauses the server, which
    keeps serving the first's weights; once the first closes, the second may send."""
    original = buckets(policy(vllm_model_dir, tokenizer))
    first, second = (engine_on(server, tokenizer, "vllm", weight_dir=str(tmp_path)) for _ in "12")
    first.load_weights(0, original)
    with pytest.raises(UserError) as refused:
        second.load_weights(7, buckets(perturbed(policy(vllm_model_dir, tokenizer), seed=7)))
    message = str(refused.value)
    assert server.url in message and "one trainer at a time" in message, message
    assert "\n" not in message and first.trainer in message
    assert not server.is_paused() and server.weight_version() == "0"
    first.close()
    second.load_weights(0, original)
    assert server.weight_version() == "0"
    second.close()


def test_a_killed_server_is_set_aside_then_sent_the_newest_weights(
    server, vllm_model_dir, tokenizer
):
    """As with honing's servers: requests to a dead server fail over (here to none: the call
    raises ``EngineUnavailable`` naming it); once it is back it is sent the newest weights
    before it serves (a restarted vLLM server holds ``model.path``'s again)."""
    local = perturbed(policy(vllm_model_dir, tokenizer), seed=5)
    engine = engine_on(server, tokenizer, "vllm", cooldown_s=0.5)
    engine.load_weights(5, WeightStream(buckets(local), again=lambda: buckets(local)))
    params = SamplingParams(n=2, max_new_tokens=3, max_seq_len=64)
    assert len(engine.generate(requests_for(tokenizer), params)) == 6
    server.kill()
    with pytest.raises(EngineUnavailable, match="ConnectError"):
        engine.generate(requests_for(tokenizer), params)
    # Restarted with vLLM's default logprobs mode: at temperature 1 without top-k or top-p raw
    # and processed logprobs are the same, so it serves here, and is the next test's server.
    server.start(logprobs_mode="raw_logprobs")
    assert server.weight_version() == "default"  # its cool-down is over meanwhile
    assert_samples_from(engine, local, tokenizer, seed=5)
    assert server.weight_version() == "5"
    engine.close()


def test_a_server_that_reports_raw_logprobs_is_refused(
    server, vllm_model_dir, tokenizer, digit_reward, tmp_path, capsys
):
    from pipeline._configs import cli_args

    for sync in ("vllm", "none"):
        with pytest.raises(ConfigError, match="--logprobs-mode processed_logprobs"):
            engine_on(server, tokenizer, sync)
    with pytest.raises(ConfigError, match="set rollout.weight_sync=vllm"):
        engine_on(server, tokenizer, "tensors")
    overrides = {"rollout.engine": "openai", "rollout.endpoints": server.url}
    args = cli_args(vllm_model_dir, digit_reward, tmp_path / "run", **overrides)
    assert honing_main(["train", *args, "rollout.weight_sync=vllm"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "--logprobs-mode processed_logprobs" in lines[0], lines
