"""The Ray backend on a local Ray cluster started here: rollout workers that give the same
samples however many there are, a dead worker replaced with its samples regenerated and
counted, workers added and removed while a run trains, errors that come back as raised."""

import json
import signal
import subprocess
import threading
import time
from dataclasses import replace

import pytest
import torch

ray = pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")  # a dependency of ray

from honing import cli  # noqa: E402
from honing.backends import ray_pools, ray_run, ray_workers  # noqa: E402
from honing.backends.launch import train  # noqa: E402
from honing.errors import ConfigError, UserError  # noqa: E402
from honing.models.loading import load_causal_lm, load_tokenizer  # noqa: E402
from honing.pipeline.weight_sync import send_weights  # noqa: E402
from honing.rollout.base import GenerationRequest, SamplingParams  # noqa: E402
from honing.rollout.native.engine import TransformersEngine  # noqa: E402
from tests import warm  # noqa: E402

from ._configs import small_run_config  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster():
    """A local Ray instance for this module, started as a run starts one (on loopback), with
    logical room for every actor."""
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    ray_run.start_local(num_cpus=8, log_to_driver=False)
    yield
    ray.shutdown()
    for sig, handler in handlers.items():  # ray.init installs its own; later tests need these
        signal.signal(sig, handler)


def _requests(model_dir, count=6):
    tokenizer = load_tokenizer(model_dir)
    return [GenerationRequest(f"p{i}", tokenizer.encode(f"{i} + {i} ="), i) for i in range(count)]


def _pool(config, model_dir, workers, rid):
    control = ray_pools.Control.remote(workers, 0)
    report = ray_pools.Report()
    engine = ray_workers.RayRolloutEngine(config, model_dir, control, rid, report)
    policy = load_causal_lm(model_dir, load_tokenizer(model_dir), dtype="float32", device="cpu")
    engine.load_weights(0, [list(policy.state_dict().items())])
    return engine, control, report, policy


def _key(rollouts):
    return [(r.prompt_id, r.group_index, r.response_ids) for r in rollouts]


# Logprobs computed in other processes (another thread count, another CPU) differ in float32's
# last bits, ~1e-6 here; a worker sampling with other weights is off by far more than this.
LOGPROB_ATOL = 1e-4


def assert_same_samples(got, want):
    """The same tokens, exactly, with the same behaviour logprobs up to float rounding."""
    assert _key(got) == _key(want)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(
            torch.tensor(a.behaviour_logprobs),
            torch.tensor(b.behaviour_logprobs),
            atol=LOGPROB_ATOL,
            rtol=0,
        )


def test_samples_are_those_of_the_chunks_for_any_number_of_workers(
    cluster, micro_model_dir, digit_reward
):
    config = small_run_config(micro_model_dir, digit_reward, **{"pipeline.rollout_chunk": 2})
    params = SamplingParams(n=3, max_new_tokens=4, seed=11)
    requests = _requests(micro_model_dir)
    one, *_ = _pool(config, micro_model_dir, 1, "chunks-one")
    two, _, _, policy = _pool(config, micro_model_dir, 2, "chunks-two")
    try:
        got = one.generate(requests, params)
        assert_same_samples(two.generate(requests, params), got)
        # each task of 2 prompts is the local engine's sampling of it with its own seed
        local = TransformersEngine(policy, load_tokenizer(micro_model_dir), device="cpu")
        want = []
        for start in range(0, len(requests), 2):
            seed = (params.seed * 1_000_003 + start) % (2**63)
            want += local.generate(requests[start : start + 2], replace(params, seed=seed))
        assert_same_samples(got, want)
        assert len(got) == 18 and one.regenerated == two.regenerated == 0
    finally:
        one.close()
        two.close()


def test_a_dead_worker_is_replaced_and_its_samples_regenerated(
    cluster, micro_model_dir, digit_reward
):
    config = small_run_config(micro_model_dir, digit_reward, **{"pipeline.rollout_chunk": 1})
    params = SamplingParams(n=2, max_new_tokens=4, seed=5)
    requests = _requests(micro_model_dir, 4)
    engine, control, report, _ = _pool(config, micro_model_dir, 2, "dead")
    try:
        before = engine.generate(requests, params)
        ray.get([worker.handle.ready.remote() for worker in engine.workers])  # both loaded
        victim = engine.workers[0]
        ray.kill(victim.handle)
        after = engine.generate(requests, params)
        assert_same_samples(after, before)  # same tasks, same seeds, another worker
        assert engine.regenerated >= params.n  # at least the one task sent to the dead one
        assert engine.regenerated % params.n == 0
        gauges, events = engine.take_report()
        assert gauges["ray/rollout_workers"] == 2
        replaced = [fields for kind, fields in events if kind == "rollout_worker_replaced"]
        assert replaced and replaced[0]["dead"] == victim.name
        assert victim not in engine.workers
    finally:
        engine.close()


def test_workers_follow_the_control_target(cluster, micro_model_dir, digit_reward):
    config = small_run_config(micro_model_dir, digit_reward)
    params = SamplingParams(n=2, max_new_tokens=3, seed=1)
    requests = _requests(micro_model_dir, 4)
    engine, control, report, _ = _pool(config, micro_model_dir, 1, "elastic")
    try:
        first = engine.generate(requests, params)
        ray.get(control.set.remote(3, None))
        assert_same_samples(engine.generate(requests, params), first)
        assert len(engine.workers) == 3
        ray.get(control.set.remote(1, None))
        engine.generate(requests, params)
        assert len(engine.workers) == 1
        _, events = engine.take_report()
        assert [(f["before"], f["after"]) for k, f in events if k.endswith("_scaled")] == [
            (1, 3),
            (3, 1),
        ]
        with pytest.raises(ray.exceptions.RayTaskError, match="rollout_workers"):
            ray.get(control.set.remote(0, None))
    finally:
        engine.close()


def test_a_worker_that_cannot_load_stops_the_call_with_its_error(
    cluster, tmp_path, micro_model_dir, digit_reward
):
    config = small_run_config(micro_model_dir, digit_reward)
    control = ray_pools.Control.remote(2, 0)
    engine = ray_workers.RayRolloutEngine(
        config, tmp_path / "missing-model", control, "broken", ray_pools.Report()
    )
    try:
        params = SamplingParams(n=2, max_new_tokens=3, seed=1)
        with pytest.raises(ray_pools.WorkersUnavailable, match="failed while starting"):
            engine.generate(_requests(micro_model_dir, 2), params)
    finally:
        engine.close()


def test_workers_speculate_and_report_it(cluster, micro_model_dir, digit_reward):
    config = small_run_config(
        micro_model_dir,
        digit_reward,
        **{"rollout.speculative": "ngram", "rollout.spec_min_accept": 0.0},
    )
    engine, *_ = _pool(config, micro_model_dir, 2, "speculating")
    try:
        engine.generate(_requests(micro_model_dir), SamplingParams(n=3, max_new_tokens=6))
        metrics, _ = engine.take_report()
        assert metrics["rollout/spec_draft_tokens"] > 0
        assert 0 <= metrics["rollout/spec_accept_rate"] <= 1
        assert "rollout/spec_draft_tokens" not in engine.take_report()[0]  # once per call
    finally:
        engine.close()


def test_workers_sample_from_a_lora_policy_merged(cluster, micro_model_dir, digit_reward):
    """A LoRA run's rollout workers hold the plain model: they get the adapters merged in,
    when the run starts and with each version sent after."""
    pytest.importorskip("peft")
    overrides = {"model.lora_rank": 4, "pipeline.backend": "ray"}
    config = small_run_config(micro_model_dir, digit_reward, **overrides)
    parts = ray_run.build_on_ray(config, log=lambda message: None)
    try:
        with torch.no_grad():
            for name, param in parts.policy.named_parameters():
                if "lora_B" in name:  # PEFT starts B at 0: make the adapters do something
                    param.normal_(0, 0.5)
        send_weights(parts, 1)
        rollouts = parts.engine.generate(_requests(micro_model_dir), SamplingParams(n=2))
        policy = parts.policy.eval()
        moved = 0.0
        for r in rollouts:
            ids = torch.tensor([r.prompt_ids + r.response_ids])
            with torch.no_grad():
                logits = policy(input_ids=ids).logits[0, len(r.prompt_ids) - 1 : -1]
                with policy.disable_adapter():
                    base = policy(input_ids=ids).logits[0, len(r.prompt_ids) - 1 : -1]
            tokens = torch.tensor(r.response_ids)[:, None]
            want = logits.log_softmax(-1).gather(-1, tokens).squeeze(-1)
            got = torch.tensor(r.behaviour_logprobs)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
            moved = max(
                moved,
                (got - base.log_softmax(-1).gather(-1, tokens).squeeze(-1)).abs().max().item(),
            )
        assert moved > 1e-3  # not the base model's
        assert parts.engine.weight_version == 1
    finally:
        parts.engine.close()


def test_workers_draft_with_the_mtp_heads_the_trainer_trains(
    cluster, micro_model_dir, digit_reward
):
    """rollout.speculative=mtp: the heads train in the trainer and go to the workers with the
    weights; drafts decide which random numbers a sampler draws, so equal samples mean equal
    heads."""
    overrides = {
        "pipeline.backend": "ray",
        "pipeline.rollout_chunk": 3,
        "rollout.speculative": "mtp",
        "rollout.spec_tokens": 2,
        "rollout.spec_min_accept": 0.0,
    }
    config = small_run_config(micro_model_dir, digit_reward, **overrides)
    parts = ray_run.build_on_ray(config, log=lambda message: None)
    try:
        with torch.no_grad():  # heads that propose something other than a fresh head's
            for param in parts.trainers.mtp.module.parameters():
                param.normal_(0, 0.3)
        send_weights(parts, 1)
        requests, params = _requests(micro_model_dir), SamplingParams(n=3, max_new_tokens=6)
        got = parts.engine.generate(requests, params)
        want = []
        for start in range(0, len(requests), 3):  # the local engine, the same heads
            seed = (params.seed * 1_000_003 + start) % (2**63)
            want += parts.val_engine.generate(
                requests[start : start + 3], replace(params, seed=seed)
            )
        assert_same_samples(got, want)
        metrics, _ = parts.engine.take_report()
        assert metrics["rollout/spec_draft_tokens"] > 0
    finally:
        parts.engine.close()


def _metrics(run_dir):
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_async_run_goes_on_while_workers_die_and_are_added(
    cluster, tmp_path, micro_model_dir, digit_reward
):
    """The trainer, two rollout workers and a reward worker as actors, async schedule: one
    rollout worker is killed and a third is added mid-run; every step trains and every
    sample is accounted for."""
    run_dir = tmp_path / "ray-run"
    config = small_run_config(
        micro_model_dir,
        digit_reward,
        **{
            "pipeline.backend": "ray",
            "pipeline.rollout_chunk": 1,
            "schedule.mode": "async",
            "trainer.total_steps": 60,
            "trainer.val_at_start": False,
            "trainer.lr": 1e-3,
            "checkpoint.every": 20,
            "rollout.max_new_tokens": 6,
        },
    )
    result, failure = {}, []

    def run():
        try:
            result.update(train(config, run_dir))
        except BaseException as err:  # noqa: BLE001 - reported by the test
            failure.append(err)

    thread = threading.Thread(target=run)
    thread.start()
    rid = ray_run.run_id(run_dir)
    deadline = time.monotonic() + 240
    workers = []
    while not workers and thread.is_alive() and time.monotonic() < deadline:
        try:  # both rollout workers loaded, so that the killed one has had work
            workers = [
                ray.get_actor(f"{rid}/rollout-{i}", namespace=ray_pools.NAMESPACE) for i in (1, 2)
            ]
            ray.get([worker.ready.remote() for worker in workers])
        except ValueError:  # not made yet
            time.sleep(0.05)
        except ray.exceptions.RayActorError:  # one died before it ran: ask for them again
            workers = []
            time.sleep(0.05)
    seen = len(_metrics(run_dir))
    while len(_metrics(run_dir)) < seen + 2 and thread.is_alive():
        time.sleep(0.01)
    assert thread.is_alive(), failure
    ray.kill(workers[0])
    killed_at = len(_metrics(run_dir))
    assert cli.main(["scale", str(run_dir), "--rollout-workers", "3"]) == 0
    thread.join(timeout=300)
    assert not thread.is_alive() and not failure, failure
    metrics = _metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(1, 61))
    for m in metrics:
        parts = ("samples/trained", "samples/filtered", "samples/failed", "samples/stale")
        assert m["samples/generated"] == sum(m[k] for k in parts)
        assert m["samples/trained"] > 0
    assert metrics[-1]["ray/rollout_workers"] == 3
    assert metrics[0]["ray/reward_workers"] == 1
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    kinds = [e["kind"] for e in events]
    assert "rollout_worker_replaced" in kinds
    assert "rollout_workers_scaled" in kinds
    assert sum(m["samples/regenerated"] for m in metrics) > 0
    assert killed_at < 55  # the kill came while steps were left to sample
    assert result["last_step"] == 60
    assert (run_dir / "checkpoints" / "step_60").is_dir()
    # the run's actors are gone with it
    with pytest.raises(ValueError):
        ray.get_actor(f"{rid}/control", namespace=ray_pools.NAMESPACE)


def test_an_error_in_the_trainer_actor_comes_back_as_raised(
    cluster, tmp_path, micro_model_dir, digit_reward
):
    missing = str(tmp_path / "nowhere.py") + ":score"
    config = small_run_config(micro_model_dir, missing, **{"pipeline.backend": "ray"})
    with pytest.raises(UserError, match="nowhere.py"):  # raised in the actor, as it was
        train(config, tmp_path / "bad")
    assert not (tmp_path / "bad").exists()  # nothing half-written
    shared = replace(config, rollout=replace(config.rollout, tensor_parallel=2))
    with pytest.raises(ConfigError, match="tensor_parallel=2 shares vLLM between torchrun"):
        train(shared, tmp_path / "bad")  # refused before Ray starts


def test_an_unplaceable_trainer_says_what_it_asked_for(
    cluster, tmp_path, micro_model_dir, digit_reward
):
    config = small_run_config(
        micro_model_dir,
        digit_reward,
        **{
            "pipeline.backend": "ray",
            "pipeline.trainer_gpus": 1,
            "pipeline.actor_start_timeout_s": 1,
        },
    )
    with pytest.raises(UserError, match="asks for 1 CPUs and 1 GPUs"):
        train(config, tmp_path / "nogpu")


def _listening(process: psutil.Process) -> set[tuple[str, int]]:
    try:
        connections = process.net_connections(kind="inet")
    except psutil.Error:  # ended meanwhile
        return set()
    return {(c.laddr.ip, c.laddr.port) for c in connections if c.status == psutil.CONN_LISTEN}


def test_the_local_instance_listens_on_loopback_alone(cluster):
    """Every server of the instance a one-machine run starts (the GCS, the raylet, the workers
    and agents they started) listens on 127.0.0.1, not on the machine's network interface;
    Ray reports the GCS there."""
    gcs = ray.get_runtime_context().gcs_address
    assert gcs.startswith("127.0.0.1:"), gcs
    nodes = [p for p in psutil.Process().children() if p.name() in ("gcs_server", "raylet")]
    assert sorted(p.name() for p in nodes) == ["gcs_server", "raylet"]
    listening = set()
    for process in nodes + [child for node in nodes for child in node.children(recursive=True)]:
        listening |= _listening(process)
    assert {ip for ip, _ in listening} <= {"127.0.0.1", "::ffff:127.0.0.1"}, listening
    assert int(gcs.rsplit(":", 1)[1]) in {port for _, port in listening}


def test_honing_scale_joins_the_local_instance_on_loopback(cluster, tmp_path):
    """``honing scale`` in a process of its own finds the run's cluster at 127.0.0.1 (Ray would
    look for it at the machine's network address, where nothing listens)."""
    address = ray.get_runtime_context().gcs_address
    command = warm.honing("scale", tmp_path, "--rollout-workers", "2", "--address", address)
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"honing: error: {tmp_path}: no run with pipeline.backend=ray is training" in (
        result.stderr
    )


def test_scale_names_a_run_that_is_not_training(cluster, tmp_path, capsys):
    assert cli.main(["scale", str(tmp_path), "--rollout-workers", "2"]) == 2
    assert "no run with pipeline.backend=ray" in capsys.readouterr().err
    assert cli.main(["scale", str(tmp_path)]) == 2


def test_workers_record_each_tokens_experts_for_replay(cluster, tmp_path, moe_dirs, digit_reward):
    """R3 with rollout workers: the workers' rollouts carry the experts their routers chose,
    and the trainer replays them (its live routers agree at the weights they sampled with)."""
    overrides = {
        "pipeline.backend": "ray",
        "algorithm.routing_replay": "R3",
        "trainer.total_steps": 2,
        "trainer.val_at_start": False,
    }
    config = small_run_config(moe_dirs["qwen3_moe"], digit_reward, **overrides)
    train(config, tmp_path / "run", log=lambda message: None)
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line) for line in lines if '"actor/pg_loss"' in line]
    assert len(steps) == 2 and all(s["moe/rollout_router_match"] >= 0.99 for s in steps)


def test_workers_run_the_turn_loop_and_the_partial_pool_samples_through_them(
    cluster, tmp_path, tagged_model_dir, digit_reward
):
    """rollout.tools under Ray: each rollout worker runs the calculator's turn loop beside its
    engine, and their tool metrics reach the step's. With schedule.partial_rollout too: the
    producer's pool continues its samples chunk by chunk through the workers, the newest
    weights loaded between chunks, and the trainer runs the turn loop, each turn's chunks
    sampled by the workers. Every sample is accounted for in each."""
    accounted = ("samples/trained", "samples/filtered", "samples/failed", "samples/stale")
    tools = {"rollout.tools": ["calculator"], "rollout.max_new_tokens": 12}
    partial = {"schedule.mode": "async", "schedule.partial_rollout": True}
    partial |= {"schedule.partial_chunk_tokens": 1, "schedule.max_staleness": 2}
    for name, model_dir, overrides in (
        ("tools", tagged_model_dir, tools),
        ("both", tagged_model_dir, tools | partial),
    ):
        values = {"pipeline.backend": "ray", "pipeline.rollout_workers": 2}
        values |= {"trainer.total_steps": 2, "trainer.val_at_start": False} | overrides
        config = small_run_config(model_dir, digit_reward, **values)
        train(config, tmp_path / name, log=lambda message: None)
        steps = [m for m in _metrics(tmp_path / name) if "samples/generated" in m]
        assert len(steps) == 2, name
        for m in steps:
            assert m["samples/generated"] == sum(m[k] for k in accounted) > 0, m
            assert m["tool/samples"] > 0, m
            if name == "tools":
                assert m["tool/samples"] == m["samples/generated"]
            else:
                assert "partial/carried_samples" in m


# two trainer actors sharding the policy (tests/pipeline/test_ray_trainers.py)
SHARDED_GROUP = {"pipeline.trainer_workers": 2, "trainer.strategy": "fsdp"}


def test_workers_hold_vllm_and_the_trainer_actor_samples_from_servers(
    cluster, tmp_path, vllm_model_dir, digit_reward
):
    """rollout.engine=vllm under Ray: a rollout worker holds vLLM in its actor and takes
    every version, gathered by two FSDP trainer actors, from the object store (the gap to the
    trainer's logprobs stays at rounding: 3e-7 to 1e-6 measured; step 2 samples from the
    version step 1 made). rollout.engine=openai under
    Ray: the trainer actor samples from the servers (honing serve rollout on loopback) and
    sends them each version; no rollout worker starts."""
    pytest.importorskip("vllm")
    process, url = warm.start_service("rollout", "--model", str(vllm_model_dir))
    try:
        vllm = {"rollout.engine": "vllm", "rollout.vllm_kv_cache_mb": 16}
        for name, overrides in (
            ("vllm", vllm | SHARDED_GROUP),
            ("servers", {"rollout.engine": "openai", "rollout.endpoints": url}),
        ):
            values = {"pipeline.backend": "ray", "pipeline.rollout_workers": 1}
            values |= {"trainer.total_steps": 2, "trainer.val_at_start": False}
            values |= {"rollout.max_seq_len": 64, "trainer.lr": 3e-3} | overrides
            config = small_run_config(vllm_model_dir, digit_reward, **values)
            train(config, tmp_path / name, log=lambda message: None)
            steps = [m for m in _metrics(tmp_path / name) if "samples/generated" in m]
            assert len(steps) == values["trainer.total_steps"], name
            for m in steps:  # a version that did not arrive is off by 0.02-0.2 nats here
                assert m["rollout_mismatch/logprob_diff_max"] < 1e-4, (name, m)
            assert ("ray/rollout_workers" in steps[-1]) == (name == "vllm")
            assert steps[-1]["dist/world_size"] == (2.0 if name == "vllm" else 1.0)
    finally:
        process.terminate()
        process.wait()


def test_the_trainer_actor_takes_the_run_directorys_lock(
    cluster, tmp_path, micro_model_dir, digit_reward
):
    """The trainer actor writes the run directory, so it takes its lock: a run into one that
    another process holds is refused with one line and writes nothing."""
    from honing.pipeline.run_lock import LOCK_FILE, RunLock

    run_dir = tmp_path / "run"
    holder = RunLock(run_dir)
    holder.acquire()
    config = small_run_config(micro_model_dir, digit_reward, **{"pipeline.backend": "ray"})
    try:
        with pytest.raises(UserError, match=r"is being written by another honing train \(pid "):
            train(config, run_dir, log=lambda message: None)
        assert [p.name for p in run_dir.iterdir()] == [LOCK_FILE]
    finally:
        holder.release()
