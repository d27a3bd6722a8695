"""``trainer.strategy=fsdp``: two CPU ranks (gloo) shard the policy, the critic, the reference
and LoRA adapters with FSDP2 and train what one process trains; checkpoints export the whole
policy in Hugging Face format and resume at another world size and under the other strategy."""

import json
import shlex
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from honing.config import build_config
from honing.errors import ConfigError
from honing.pipeline import checkpoint_files
from honing.pipeline.rules import check_config
from honing.trainer.sharded import decoder_layers
from tests import warm

from ._configs import BASE
from .test_data_parallel_run import OVERRIDES, assert_same_moves, initial_weights

ONE_PROCESS_SAMPLING = {"pipeline.spread_generation": False, "checkpoint.every": 1}
PPO = {"algorithm.advantage": "gae", "trainer.critic_warmup_steps": 1, "trainer.mini_batch_size": 2}
LORA = {"model.lora_rank": 4, "model.lora_target_modules": "[q_proj,v_proj]"}


def run(tmp_path, name, model_dir, reward, ranks, steps, strategy="fsdp", **overrides):
    """``honing train`` on ``ranks`` torchrun ranks (1: one plain process), started warm
    (``tests/warm.py``); the metrics of steps >= 1 and the policy's weights of the last
    checkpoint."""
    values = OVERRIDES | ONE_PROCESS_SAMPLING | overrides
    values |= {"model.path": model_dir, "reward.function": reward, "trainer.total_steps": steps}
    values["trainer.strategy"] = strategy
    args = ["train", *(f"{k}={v}" for k, v in values.items()), "--output-dir", tmp_path / name]
    command = warm.torchrun(ranks, *args) if ranks > 1 else warm.honing(*args)
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
    checkpoint = tmp_path / name / "checkpoints" / f"step_{steps}"
    weights = {}
    for shard in checkpoint.glob("*.safetensors"):
        weights |= load_file(shard)
    return [m for m in map(json.loads, lines) if m["step"] >= 1], weights, result.stderr


def _tied(weights: dict) -> dict:
    """A tied head is the embedding: compare it once (exports differ in whether they list it)."""
    return {k: v for k, v in weights.items() if not k.endswith("lm_head.weight")}


@pytest.mark.slow
@pytest.mark.parametrize("variant", [{}, PPO, LORA], ids=["grpo", "ppo-critic", "lora"])
def test_two_sharded_ranks_train_what_one_process_does(
    tmp_path, micro_model_dir, digit_reward, variant
):
    args = (micro_model_dir, digit_reward)
    kl = {} if variant is LORA else {"algorithm.kl_coef": 0.05}  # a sharded reference too
    one, one_weights, _ = run(tmp_path, "one", *args, 1, 2, strategy="replicate", **variant | kl)
    two, two_weights, _ = run(tmp_path, "two", *args, 2, 2, **variant | kl)
    assert one[0]["critic/score/mean"] == two[0]["critic/score/mean"]  # the same samples
    assert one[1]["critic/score/mean"] == two[1]["critic/score/mean"]
    assert _tied(one_weights).keys() <= two_weights.keys()
    for name, want in _tied(one_weights).items():
        torch.testing.assert_close(two_weights[name], want, atol=1e-4, rtol=0)
    assert [m["dist/world_size"] for m in two] == [2.0, 2.0]
    assert [m["dist/strategy"] for m in one + two] == [0.0, 0.0, 2.0, 2.0]
    # each rank holds its half of the parameters, gradients and optimizer state
    assert two[-1]["memory/model_state_mb"] <= 0.55 * one[-1]["memory/model_state_mb"]
    assert two[-1]["perf/sync_mb"] > 0  # the engine's own copy took the gathered weights


@pytest.mark.slow
def test_two_sharded_ranks_under_one_step_train_what_one_process_does(
    tmp_path, micro_model_dir, digit_reward
):
    """one_step: rank 0's producer samples step k with version k - 2 while both ranks train;
    at each step's end both gather the new weights, which rank 0 publishes to the producer.
    The schedule is deterministic, so the runs match."""
    args = (micro_model_dir, digit_reward)
    ahead = {"schedule.mode": "one_step"}
    one, one_weights, _ = run(tmp_path, "one", *args, 1, 2, strategy="replicate", **ahead)
    two, two_weights, _ = run(tmp_path, "two", *args, 2, 2, **ahead)
    assert [m["async/weight_version"] for m in two] == [0.0, 0.0]
    for mine, theirs in zip(two, one, strict=True):
        assert mine["critic/score/mean"] == theirs["critic/score/mean"]  # the same samples
    for name, want in _tied(one_weights).items():
        torch.testing.assert_close(two_weights[name], want, atol=1e-4, rtol=0)


def _mtp_heads(checkpoint) -> dict:
    """The MTP heads a checkpoint holds: whole in trainer_state.pt, or in a sharded run's
    shards (written by rank 0, which alone trains them)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    state = torch.load(checkpoint / "trainer_state.pt", weights_only=False)
    if "trainers" in state:
        return state["trainers"]["mtp"]["module"]
    shards = checkpoint / "trainer"
    prefix = "mtp.module."
    stored = FileSystemReader(shards).read_metadata().state_dict_metadata
    heads = {k: torch.empty(v.size) for k, v in stored.items() if k.startswith(prefix)}
    dcp.load(heads, checkpoint_id=str(shards), no_dist=True)
    return {name.removeprefix(prefix): tensor for name, tensor in heads.items()}


@pytest.mark.slow
def test_two_sharded_ranks_train_the_mtp_heads_one_process_does(
    tmp_path, micro_model_dir, digit_reward
):
    """rollout.speculative=mtp under FSDP: rank 0 drafts with the heads on its whole copy of
    the policy and trains them from that copy once the step's weights reached it; the heads
    and the policy end where one process's do, and the checkpoint holds rank 0's heads."""
    args = (micro_model_dir, digit_reward)
    heads = {"rollout.speculative": "mtp", "rollout.spec_min_accept": 0.0}
    heads |= {"rollout.max_new_tokens": 8}
    one, one_weights, _ = run(tmp_path, "one", *args, 1, 2, strategy="replicate", **heads)
    two, two_weights, _ = run(tmp_path, "two", *args, 2, 2, **heads)
    for mine, theirs in zip(two, one, strict=True):
        assert mine["critic/score/mean"] == theirs["critic/score/mean"]  # the same samples
        assert mine["mtp/loss"] == pytest.approx(theirs["mtp/loss"], abs=1e-4)
    for name, want in _tied(one_weights).items():
        torch.testing.assert_close(two_weights[name], want, atol=1e-4, rtol=0)
    want = _mtp_heads(tmp_path / "one" / "checkpoints" / "step_2")
    got = _mtp_heads(tmp_path / "two" / "checkpoints" / "step_2")
    assert want.keys() == got.keys()
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_checkpoints_resume_at_any_world_size_and_strategy(tmp_path, micro_model_dir, digit_reward):
    """One run, each step on another world size or strategy: 2 sharded -> 1 -> 3 sharded ->
    2 replicated ranks (sharded into one process, one process into shards, shards into
    replicas); it ends where an uninterrupted process does."""
    args = (micro_model_dir, digit_reward)
    _, whole, _ = run(tmp_path, "whole", *args, 1, 4, strategy="replicate", **PPO)
    hops = [(2, "fsdp"), (1, "fsdp"), (3, "fsdp"), (2, "replicate")]
    for step, (ranks, strategy) in enumerate(hops, start=1):
        trained, weights, _ = run(tmp_path, "hops", *args, ranks, step, strategy=strategy, **PPO)
    assert [m["step"] for m in trained] == [1, 2, 3, 4]
    assert_same_moves(_tied(weights), _tied(whole), initial_weights(micro_model_dir))


def test_a_sharded_export_is_a_hugging_face_model_in_several_files(
    tmp_path, micro_model_dir, monkeypatch
):
    """The export writer streams tensors into files of at most MAX_SHARD_BYTES with
    Hugging Face's index; ``from_pretrained`` loads them as the model they came from."""
    model = AutoModelForCausalLM.from_pretrained(micro_model_dir)
    monkeypatch.setattr(checkpoint_files, "MAX_SHARD_BYTES", 40_000)
    checkpoint_files.write_weight_files(model.state_dict().items(), tmp_path, writer=True)
    model.config.save_pretrained(tmp_path)
    shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_a_rank_that_writes_nothing_still_takes_every_piece(tmp_path):
    """Gathering a piece is collective: every rank consumes them all, rank 0 alone writes."""
    taken = []
    pieces = ((name, torch.zeros(3)) for name in ("a", "b") if not taken.append(name))
    checkpoint_files.write_weight_files(pieces, tmp_path, writer=False)
    assert taken == ["a", "b"] and not list(tmp_path.iterdir())


def test_a_model_without_decoder_layers_cannot_be_sharded():
    with pytest.raises(ConfigError, match="Linear has no list of decoder layers .*=replicate"):
        decoder_layers(torch.nn.Linear(2, 2))


@pytest.mark.parametrize(
    "override, message",
    [
        ({"memory.dynamic_offload": True}, "memory.dynamic_offload"),
    ],
)
def test_what_sharding_does_not_take_yet_is_one_line(override, message):
    with pytest.raises(ConfigError, match=message):
        check_config(build_config(BASE | {"trainer.strategy": "fsdp"} | override))


def test_offload_keys_need_the_sharded_strategy():
    with pytest.raises(ConfigError, match="memory.param_offload applies to trainer.strategy=fsdp"):
        check_config(build_config({"memory.param_offload": True}))


def test_fsdp_without_torchrun_trains_as_one_process_and_says_so(
    tmp_path, micro_model_dir, digit_reward
):
    _, _, stderr = run(tmp_path, "alone", micro_model_dir, digit_reward, 1, 1)
    said = [line for line in stderr.splitlines() if "trainer.strategy=fsdp" in line]
    assert said == ["trainer.strategy=fsdp: one process (not launched by torchrun): trains whole"]


@pytest.mark.parametrize("strategy", ["replicate", "fsdp"])
@pytest.mark.parametrize(
    "values, ranks, message",
    [
        ({"rollout.batch_size": 1, "rollout.group_size": 2}, 3, "a mini-batch of 2 sequences"),
        (
            {"rollout.batch_size": 4, "rollout.group_size": 2, "trainer.mini_batch_size": 1},
            3,
            "2 sequences (.*); raise trainer.mini_batch_size, or run at most 2 ranks",
        ),
        (
            {"rollout.batch_size": 5, "rollout.group_size": 2, "trainer.mini_batch_size": 2},
            3,
            "2 sequences (.*); make trainer.mini_batch_size divide rollout.batch_size",
        ),
        (
            {"rollout.batch_size": 4, "rollout.group_size": 2, "algorithm.dynamic_sampling": True},
            3,
            "dynamic_sampling may train a batch of one group, whose rollout.group_size=2 seq",
        ),
    ],
)
def test_a_mini_batch_smaller_than_the_ranks_is_refused_at_the_start(
    strategy, values, ranks, message
):
    config = build_config(BASE | values | {"trainer.strategy": strategy})
    with pytest.raises(ConfigError, match=message):
        check_config(config, world_size=ranks)
    check_config(config, world_size=2)  # 2 sequences: one for each of 2 ranks


def test_three_ranks_that_cannot_share_a_batch_stop_before_loading(tmp_path, micro_model_dir):
    """What each rank says, launched by torchrun (the world size its environment gives)."""
    args = [f"model.path={micro_model_dir}", "trainer.strategy=fsdp", "rollout.batch_size=1"]
    args += ["rollout.group_size=2", "--output-dir", tmp_path / "run"]
    command = warm.torchrun(3, "train", *args)
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "ValueError" not in result.stderr
    said = {line for line in result.stderr.splitlines() if line.startswith("honing: error: ")}
    # one line on every rank that got to say it before torchrun stopped the others
    assert said == {
        "honing: error: a mini-batch of 2 sequences (rollout.batch_size=1, group_size=2, "
        "trainer.mini_batch_size=0) cannot be shared by 3 torchrun ranks; raise "
        "rollout.batch_size or group_size, or run at most 2 ranks"
    }
    assert not (tmp_path / "run").exists()


def test_ranks_launched_with_different_configs_fail_at_once(tmp_path, micro_model_dir):
    """Each rank reads its own top_k from the environment torchrun gives it."""
    train = shlex.join(warm.honing("train", f"model.path={micro_model_dir}"))
    script = f"exec {train} rollout.top_k=$RANK --output-dir {tmp_path / 'run'}"
    command = [*warm.launcher(2), "--no-python", "sh", "-c", script]
    started = time.monotonic()
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and time.monotonic() - started < 60
    said = "honing: error: rank 1 was launched with another config than rank 0 (differs in: "
    assert result.stderr.count(said + "rollout.top_k)") == 2  # one line on every rank


@pytest.mark.slow
def test_a_killed_rank_is_restarted_and_the_run_resumes(tmp_path, micro_model_dir, digit_reward):
    """SIGKILL to rank 1 after the first checkpoint, under ``torchrun --max-restarts 1``: both
    ranks start again, resume from the newest verified checkpoint, and end where a run that
    was never killed does."""
    import psutil

    args = (micro_model_dir, digit_reward)
    _, whole, _ = run(tmp_path, "whole", *args, 2, 3)
    values = OVERRIDES | ONE_PROCESS_SAMPLING | {"trainer.strategy": "fsdp"}
    values |= {"model.path": micro_model_dir, "reward.function": digit_reward}
    values["trainer.total_steps"] = 3
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    command += ["--standalone", "--max-restarts", "1", "-m", "honing.cli", "train"]
    command += [*(f"{k}={v}" for k, v in values.items()), "--output-dir", str(tmp_path / "run")]
    log = (tmp_path / "torchrun.log").open("w")  # a pipe left unread would fill and block them
    launcher = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    first = tmp_path / "run" / "checkpoints" / "step_1" / "COMPLETE"
    deadline = time.monotonic() + 120
    while not first.exists():
        assert launcher.poll() is None and time.monotonic() < deadline, "no first checkpoint"
        time.sleep(0.05)
    ranks = [p for p in psutil.Process(launcher.pid).children(recursive=True)]
    [victim] = [p for p in ranks if p.environ().get("RANK") == "1"]
    victim.kill()
    launcher.wait(timeout=240)
    log.close()
    assert launcher.returncode == 0, (tmp_path / "torchrun.log").read_text()[-6000:]
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").open()]
    resumed = [e["step"] for e in events if e["kind"] == "resumed"]
    assert len(resumed) == 1 and resumed[0] >= 1
    weights = load_file(tmp_path / "run" / "checkpoints" / "step_3" / "model.safetensors")
    for name, want in whole.items():
        torch.testing.assert_close(weights[name], want, atol=1e-6, rtol=1e-5)
