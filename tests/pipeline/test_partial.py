"""Partial rollouts (schedule.partial_rollout): samples carried across steps and weight
updates, every token with the version that made it and the logprob it was sampled with;
accounting over a run; a resume neither loses nor doubles a prompt; what is refused."""

import copy
import json
import os
import signal
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from honing.checkpoint import CheckpointManager
from honing.cli import stop_on_sigterm
from honing.config import build_config
from honing.data import PromptSource, arithmetic_prompts
from honing.errors import ConfigError, RunStopped, Terminated
from honing.models.loading import load_causal_lm, load_tokenizer
from honing.pipeline.partial import Group, PartialPool, Sample
from honing.pipeline.rules import check_config
from honing.rollout.base import SamplingParams
from honing.rollout.native.engine import TransformersEngine
from honing.types import Prompt

from .test_loop_logic import ACCOUNTED, config, run, steps

PARTIAL = {
    "schedule.mode": "async",
    "schedule.partial_rollout": True,
    "schedule.max_staleness": 2,
    "schedule.partial_chunk_tokens": 1,
}


def test_a_sample_spanning_two_versions_keeps_each_tokens_version_and_logprob(
    micro_model_dir,
):
    """Two tokens by version 0, then the weights change (version 1) and the sample goes on:
    each token's behaviour logprob is its own version's log-softmax at that position,
    recomputed here with the model's own forward, and its version is the one recorded."""
    tokenizer = load_tokenizer(micro_model_dir)
    cpu = torch.device("cpu")
    old = load_causal_lm(micro_model_dir, tokenizer, dtype="float32", device="cpu")
    new = load_causal_lm(micro_model_dir, tokenizer, dtype="float32", device="cpu")
    with torch.no_grad():
        for param in new.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    engine = TransformersEngine(copy.deepcopy(old), tokenizer, device=cpu)  # loads into it
    ids = tokenizer.encode("12+34=", add_special_tokens=False)
    parts = SimpleNamespace(
        engine=engine,
        tokenizer=tokenizer,
        prompt_ids={"p": ids},
        train_sampling=SamplingParams(n=2, max_new_tokens=6, max_seq_len=64, seed=1),
    )
    pool = PartialPool(parts, group_size=2, batch_size=1, chunk_tokens=2, max_staleness=2)
    pool.add([Prompt("p", "12+34=", "46")])
    pool.chunk(seed=5)
    engine.load_weights(1, [[(n, t.detach().clone()) for n, t in new.state_dict().items()]])
    while pool.ready() < 1:
        pool.chunk(seed=5)
    [group] = pool.take()
    rollouts = pool.rollouts([group], engine.weight_version)
    spanned = 0
    for rollout in rollouts:
        versions = rollout.token_versions()
        assert versions[:2] == [0, 0] and set(versions[2:]) <= {1}
        spanned += len(rollout.version_spans) > 1
        assert rollout.weight_version == 0  # its oldest token's
        tokens = torch.tensor([ids + rollout.response_ids])
        for model, version in ((old, 0), (new, 1)):
            with torch.no_grad():
                logp = model(tokens).logits[0, len(ids) - 1 : -1].log_softmax(-1)
            expected = logp.gather(-1, torch.tensor(rollout.response_ids)[:, None])[:, 0]
            mine = torch.tensor(rollout.behaviour_logprobs)
            at = torch.tensor(versions) == version
            torch.testing.assert_close(mine[at], expected[at], atol=2e-5, rtol=0)
    assert spanned >= 1  # a sample that ended within its first chunk spans one version


def test_a_batch_takes_the_groups_that_finished_and_carries_the_others(micro_model_dir):
    """Batch size 1 of 2 groups in flight: the first group done is taken; the other stays,
    goes on with the next weights, and is taken by the next batch with both versions."""
    tokenizer = load_tokenizer(micro_model_dir)
    model = load_causal_lm(micro_model_dir, tokenizer, dtype="float32", device="cpu")
    engine = TransformersEngine(model, tokenizer, device=torch.device("cpu"))
    engine.stop_ids = set()  # no EOS: samples end at max_new_tokens, as the test needs
    prompts = {"short": "1+1=", "long": "12+34="}
    parts = SimpleNamespace(
        engine=engine,
        tokenizer=tokenizer,
        prompt_ids={k: tokenizer.encode(v, add_special_tokens=False) for k, v in prompts.items()},
        train_sampling=SamplingParams(n=1, max_new_tokens=8, max_seq_len=64, greedy=True),
    )
    pool = PartialPool(parts, group_size=1, batch_size=1, chunk_tokens=1, max_staleness=3)
    assert pool.room(step=1, version=0) == 2  # two batches' worth
    pool.add([Prompt(k, v, "") for k, v in prompts.items()])
    pool.chunk(seed=0)  # a token each, by version 0
    pool.groups[0].samples[0].finish = "stop"  # the short one is done; the long one is not
    assert not pool.groups[1].done
    [first] = pool.take()
    assert first.prompt.id == "short" and [g.prompt.id for g in pool.groups] == ["long"]
    engine.weight_version = 1  # the next weights (the same values: versions are what count)
    while pool.ready() < 1:
        pool.chunk(seed=0)
    [rollout] = pool.rollouts(pool.take(), engine.weight_version)
    assert rollout.prompt_id == "long" and rollout.finish_reason == "length"
    assert rollout.token_versions() == [0] + [1] * 7
    # room: groups started with version 1 must be trained by step 5 (max_staleness 3)
    assert pool.room(step=4, version=1) == 2 and pool.room(step=5, version=1) == 1
    assert pool.room(step=6, version=1) == 0


def test_every_sample_is_accounted_for_over_20_steps(tmp_path, digit_reward):
    cfg = config(digit_reward, **PARTIAL | {"trainer.total_steps": 20, "rollout.max_new_tokens": 6})
    run(cfg, tmp_path / "run")
    trained = steps(tmp_path / "run")
    assert [m["step"] for m in trained] == list(range(1, 21))
    for m in trained:
        assert m["samples/generated"] == 6 == sum(m[k] for k in ACCOUNTED)
        assert 0 <= m["async/staleness"] <= 2
        ages = sum(v for k, v in m.items() if k.startswith("partial/tokens_age"))
        assert ages == m["response_length/mean"] * 6


def trained_prompts(run_dir) -> dict[int, set[str]]:
    """The rendered prompts each step trained on (samples.jsonl: every sample logged)."""
    lines = (run_dir / "samples.jsonl").read_text().splitlines()
    by_step: dict[int, set[str]] = {}
    for sample in map(json.loads, lines):
        by_step.setdefault(sample["step"], set()).add(sample["prompt"])
    return by_step


def test_a_resume_mid_run_neither_loses_nor_doubles_a_prompt(tmp_path, digit_reward):
    """Stopped at step 4 (an alert: checkpoint, then stop) with batches made ahead and groups
    in the pool: the checkpoint lists those prompts; the resumed run trains each of them,
    and none that steps 1-4 trained."""
    values = PARTIAL | {"monitor.log_samples": 6, "checkpoint.every": 2, "trainer.total_steps": 12}
    stop = {"monitor.alerts": ["critic/score/mean > -1 for 4 steps -> stop"]}
    with pytest.raises(RunStopped):
        run(config(digit_reward, **values | stop), tmp_path / "r")
    state = json.loads((tmp_path / "r/checkpoints/step_4/state.json").read_text())
    requeued = state["data"]["requeue"]
    assert requeued  # drawn before the stop, not trained by step 4
    cfg = config(digit_reward, **values)
    run(cfg, tmp_path / "r")  # --resume auto
    after = trained_prompts(tmp_path / "r")
    assert sorted(after) == list(range(1, 13))
    first = set().union(*(after[s] for s in range(1, 5)))
    later = [p for s in range(5, 13) for p in after[s]]
    assert len(later) == len(set(later)) == 16 and not set(later) & first  # none doubled
    digits = {"max_digits": cfg.data.max_digits, "min_digits": cfg.data.min_digits}
    train = arithmetic_prompts("train", cfg.data.train_size, cfg.trainer.seed, **digits)
    assert {train[i].prompt for i in requeued} <= set(later)  # none lost


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"schedule.mode": "sync"}, "set schedule.mode=async or one_step"),
        ({"schedule.mode": "one_step"}, None),
        ({"rollout.engine": "vllm"}, None),
        ({"rollout.engine": "vllm", "schedule.partial_kv": "keep"}, None),
        (
            {"rollout.engine": "openai", "rollout.endpoints": "http://127.0.0.1:9"},
            None,
        ),
        (
            {
                "rollout.engine": "openai",
                "rollout.endpoints": "http://127.0.0.1:9",
                "schedule.partial_kv": "keep",
            },
            "use schedule.partial_kv=recompute",
        ),
        (
            {"schedule.partial_rollout": False, "schedule.partial_kv": "keep"},
            "applies to schedule.partial_rollout=true",
        ),
        ({"pipeline.backend": "ray"}, None),
        ({"pipeline.backend": "ray", "rollout.tools": ["calculator"]}, None),
        (
            {"pipeline.backend": "ray", "schedule.partial_kv": "keep"},
            "not supported with pipeline.backend=ray and schedule.partial_kv=keep",
        ),
        ({"algorithm.routing_replay": "R3"}, None),
        (
            {"algorithm.routing_replay": "R3", "schedule.partial_kv": "keep"},
            "not supported with algorithm.routing_replay=R3 and schedule.partial_kv=keep",
        ),
        ({"rollout.tools": ["calculator"]}, None),
        (
            {"rollout.tools": ["calculator"], "schedule.partial_kv": "keep"},
            "not supported with rollout.tools and schedule.partial_kv=keep",
        ),
    ],
)
def test_what_partial_rollouts_do_not_take_is_refused_in_one_line(overrides, message):
    cfg = build_config(PARTIAL | overrides)
    if message is None:  # taken
        check_config(cfg)
        return
    with pytest.raises(ConfigError, match=message):
        check_config(cfg)


def test_a_resumed_source_serves_the_requeued_prompts_first():
    prompts = arithmetic_prompts("train", 10, 0)
    source = PromptSource(prompts, 2, seed=0)
    drawn = source.next_batch() + source.next_batch()
    state = source.state_dict(requeue=[drawn[1], drawn[3]])  # drawn, not trained
    again = PromptSource(prompts, 2, seed=0)
    again.load_state_dict(json.loads(json.dumps(state)))
    assert again.next_batch(3)[:2] == [drawn[1], drawn[3]]
    assert again.state_dict() == source.state_dict() | {"position": 5}


def test_sigterm_mid_run_then_resume_auto_neither_loses_nor_doubles(tmp_path, digit_reward):
    """SIGTERM while samples are in flight and batches made ahead: the run ends as after
    Ctrl-C (no save); --resume auto goes on from the last periodic checkpoint, whose cursor
    lists the prompts drawn and not trained, and trains each once."""
    values = PARTIAL | {"monitor.log_samples": 6, "checkpoint.every": 2, "data.train_size": 400}
    run_dir = tmp_path / "r"

    def kill_after_step_4():
        while not (run_dir / "checkpoints" / "step_4").is_dir():
            time.sleep(0.005)
        os.kill(os.getpid(), signal.SIGTERM)

    killer = threading.Thread(target=kill_after_step_4, daemon=True)
    with stop_on_sigterm(), pytest.raises(Terminated):
        killer.start()
        run(config(digit_reward, **values | {"trainer.total_steps": 100000}), run_dir)
    killer.join()
    resumed = CheckpointManager(run_dir / "checkpoints", keep=10).complete_steps()[-1]
    state = json.loads((run_dir / f"checkpoints/step_{resumed}/state.json").read_text())
    requeued = state["data"]["requeue"]
    cfg = config(digit_reward, **values | {"trainer.total_steps": resumed + 6})
    run(cfg, run_dir)  # --resume auto
    after = trained_prompts(run_dir)
    assert sorted(after) == list(range(1, resumed + 7))
    every = [p for s in sorted(after) for p in after[s]]
    assert len(every) == len(set(every))  # none trained twice
    later = {p for s in range(resumed + 1, resumed + 7) for p in after[s]}
    digits = {"max_digits": cfg.data.max_digits, "min_digits": cfg.data.min_digits}
    train = arithmetic_prompts("train", cfg.data.train_size, cfg.trainer.seed, **digits)
    assert requeued and {train[i].prompt for i in requeued} <= later  # none lost


def test_groups_that_cannot_wait_are_ended_and_taken_first():
    """Due at step 5 (version 3, max_staleness 1): ended and taken first. Due at step 6:
    two groups for one slot, so the unfinished one is ended now too, to be taken next."""
    pool = PartialPool(None, group_size=1, batch_size=1, chunk_tokens=1, max_staleness=1)

    def group(name, version, finish):
        sample = Sample(0, ids=[5, 6], logprobs=[-1.0, -1.0], spans=[[version, 2]], finish=finish)
        return Group(Prompt(name, name, ""), [sample])

    pool.groups = [group("late", 4, None), group("due", 3, None), group("done", 4, "stop")]
    assert pool.end_stale(step=5) == 2
    assert [g.prompt.id for g in pool.take()] == ["due"]
    assert [g.prompt.id for g in pool.take()] in (["late"], ["done"])
    assert pool.groups[0].done


@pytest.mark.parametrize(
    "mode, kv", [("async", "keep"), ("one_step", "recompute")], ids=["async-keep", "one_step"]
)
def test_a_run_on_honings_engine_continues_samples(
    tmp_path, micro_model_dir, digit_reward, mode, kv
):
    """A 6-step run of the micro model in chunks of 2 tokens: every sample is accounted
    for, and with partial_kv=keep the engine continued samples from their kept caches.
    (Whether a sample spans two versions in a run depends on which side is faster; the pool
    tests above make them span.)"""
    from honing.backends.launch import train

    from ._configs import small_run_config

    values = PARTIAL | {
        "schedule.mode": mode,
        "schedule.partial_kv": kv,
        "schedule.partial_chunk_tokens": 2,
        "rollout.max_new_tokens": 8,
        "trainer.total_steps": 6,
        "trainer.val_at_start": False,
    }
    cfg = small_run_config(micro_model_dir, digit_reward, **values)
    train(cfg, tmp_path / "run", log=lambda message: None)
    trained = steps(tmp_path / "run")
    assert [m["step"] for m in trained] == list(range(1, 7))
    for m in trained:
        assert m["samples/generated"] == 6 == sum(m[k] for k in ACCOUNTED)
        assert m["async/staleness"] <= (2 if mode == "async" else 1)
    kept = sum(m.get("partial/kv_kept_tokens", 0) for m in trained)
    assert (kept > 0) == (kv == "keep")


def test_keeping_the_cache_needs_an_engine_that_keeps_it(micro_model_dir):
    tokenizer = load_tokenizer(micro_model_dir)
    model = load_causal_lm(micro_model_dir, tokenizer, dtype="float32", device="cpu")
    slow = TransformersEngine(model, tokenizer, device=torch.device("cpu"), fast_decode=False)
    parts = SimpleNamespace(engine=slow)
    with pytest.raises(ConfigError, match="use schedule.partial_kv=recompute"):
        PartialPool(
            parts, group_size=2, batch_size=1, chunk_tokens=2, max_staleness=2, keep_kv=True
        )
