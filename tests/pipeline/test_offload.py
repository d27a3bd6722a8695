"""memory.dynamic_offload: on this CPU machine it says once that it does nothing; its
bookkeeping (when it moves, what comes back, the metrics) runs with a memory probe a test
controls. The device-to-host moves themselves need a GPU (not measured here)."""

import json

import torch

from honing.backends.launch import train
from honing.pipeline.components import build_components
from honing.pipeline.offload import Offloader

from ._configs import small_run_config


def events(run_dir):
    lines = (run_dir / "events.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_on_a_cpu_machine_it_says_once_that_it_does_nothing(
    tmp_path, micro_model_dir, digit_reward
):
    config = small_run_config(
        micro_model_dir,
        digit_reward,
        **{"memory.dynamic_offload": True, "trainer.total_steps": 2},
    )
    train(config, tmp_path / "run", log=lambda m: None)
    inactive = [e for e in events(tmp_path / "run") if e["kind"] == "offload_inactive"]
    assert len(inactive) == 1 and "no CUDA device" in inactive[0]["reason"]


def test_state_moves_out_above_the_threshold_and_back_before_the_update(
    micro_model_dir, digit_reward
):
    config = small_run_config(
        micro_model_dir, digit_reward, **{"memory.dynamic_offload": True, "algorithm.kl_coef": 0.1}
    )
    parts = build_components(config, log=lambda m: None)
    for param in parts.policy.parameters():  # optimizer state to move
        param.grad = torch.ones_like(param)
    parts.trainers.policy.optimizer.step()
    before = {
        k: v.clone() for k, v in parts.trainers.policy.optimizer.state_dict()["state"][0].items()
    }
    usage = {"now": 0.5}
    seen = []
    offload = Offloader(
        config.memory,
        "sync",
        parts,
        lambda kind, **fields: seen.append(kind),
        probe=lambda device: usage["now"],
    )
    assert offload.before_generation() == {} and offload.before_update() == {}
    usage["now"] = 0.9
    out = offload.before_generation()
    assert out["timing_s/offload"] >= 0 and out["memory/offloaded_gb"] > 0
    assert all(p.grad is None for p in parts.policy.parameters())  # dropped, not moved
    assert offload.before_generation() == {}  # already out
    back = offload.before_update()
    assert back["timing_s/reload"] >= 0 and not offload.moved
    after = parts.trainers.policy.optimizer.state_dict()["state"][0]
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert seen == []
    async_run = Offloader(config.memory, "async", parts, lambda kind, **f: seen.append(f))
    assert not async_run.active and "async" in seen[0]["reason"]
