"""``trainer.expert_parallel``: ``honing train`` on two torchrun ranks that share a
mixture-of-experts policy's routed experts (each holds half of every layer's, and every token
goes to the rank of its experts) trains what one process trains, under R3 and the router
losses: the same ``moe/*`` statistics, the exported weights within 1e-4 after two steps, a
checkpoint that resumes in one process; and what it does not take is one line."""

import shutil

import pytest
import torch

from honing.config import build_config
from honing.errors import ConfigError
from honing.pipeline.rules import check_config

from ._configs import BASE
from .test_sharded_run import run

EP = {"trainer.expert_parallel": 2}
# R3 fixes every update pass's routing to the rollout's, so no last-bit difference between
# the runs flips an expert choice; micro-batches of one row are the same micro-batches in
# both runs, so the router losses (per micro-batch) are too
R3 = {
    "algorithm.routing_replay": "R3",
    "algorithm.router_aux_coef": 0.01,
    "algorithm.router_z_coef": 0.001,
    "trainer.micro_batch_size": 1,
    "trainer.packed_forward": False,
}
# continuous: the step's losses and the router's entropy, which follow the weights (step 2's
# differ from one process's by ~1e-5: the entropy by 1.6e-6 under AVX2 kernels)
COMPARED = ("actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "moe/aux_loss", "moe/z_loss")
COMPARED += ("moe/router_entropy",)
# counts of routing decisions, fixed by the replayed plan: equal
STATISTICS = ("moe/rollout_router_match", "moe/load_violation/max")


def _close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert got.keys() == want.keys()
    return max(float((got[name] - want[name]).abs().max()) for name in want)


@pytest.mark.slow
@pytest.mark.parametrize(
    "family, strategy, ranks, values",
    [
        ("mixtral", "fsdp", 2, {}),  # FSDP shards all but the experts over both ranks
        # one mesh (edp=1, ep=2, tp=2): each slot's two ranks split the attention, the two
        # slots share the experts, each slot holds the rest whole
        ("qwen3_moe", "replicate", 4, {"trainer.tensor_parallel": 2}),
    ],
    ids=["mixtral-fsdp", "qwen3_moe-replicate-tp2"],
)
def test_expert_parallel_ranks_train_what_one_process_does_and_resume_in_one(
    tmp_path, moe_dirs, digit_reward, family, strategy, ranks, values
):
    """Two steps on ranks sharing the experts against two in one process: the same samples,
    losses and statistics each step, the exports within 1e-4; the first step's checkpoint
    (the experts gathered whole into Hugging Face files as ``save_pretrained`` writes them;
    the optimizer's expert moments in shards) resumes in one process to the second step's
    weights."""
    args = (moe_dirs[family], digit_reward)
    one, one_weights, _ = run(tmp_path, "one", *args, 1, 2, strategy="replicate", **R3)
    two, two_weights, _ = run(tmp_path, "two", *args, ranks, 2, strategy, **R3 | EP | values)
    for a, b in zip(one, two, strict=True):
        assert a["critic/score/mean"] == b["critic/score/mean"]  # the same samples
        for key in COMPARED:
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
        for key in STATISTICS:  # over the same tokens, routed by the same plan
            assert b[key] == pytest.approx(a[key], abs=1e-6), key
        assert 1.0 <= b["ep/load_imbalance/mean"] <= b["ep/load_imbalance/max"] <= 2.0
        assert 0 < b["memory/expert_state_mb"] < b["memory/model_state_mb"]
    assert _close(two_weights, one_weights) < 1e-4
    shutil.rmtree(tmp_path / "two" / "checkpoints" / "step_2")  # resume from step 1's
    _, weights, stderr = run(tmp_path, "two", *args, 1, 2, strategy="replicate", **R3)
    assert "resum" in stderr.lower()
    assert _close(weights, one_weights) < 1e-4


@pytest.mark.parametrize(
    "values, ranks, message",
    [
        ({}, 1, "trainer.expert_parallel=2 needs torchrun ranks to share the experts; launch "),
        ({}, 3, "trainer.expert_parallel=2: 3 torchrun ranks do not split into groups of 2;"),
        ({"trainer.tensor_parallel": 2}, 2, "2 torchrun ranks make 1 data-parallel slots"),
        (
            {"trainer.sequence_parallel": 2},
            4,
            "trainer.expert_parallel=2 does not combine with trainer.sequence_parallel=2 yet",
        ),
        ({"model.lora_rank": 4}, 2, "does not combine with model.lora_rank=4 yet"),
    ],
)
def test_what_expert_parallelism_does_not_take_is_one_line(values, ranks, message):
    with pytest.raises(ConfigError, match=message) as refused:
        check_config(build_config(BASE | EP | values), world_size=ranks)
    assert "\n" not in str(refused.value)
    check_config(build_config(BASE | EP), world_size=4)  # 2 groups of 2 slots


def test_the_documented_expert_imbalance_alert_parses_and_fires():
    from pathlib import Path

    from honing.monitor.alerts import AlertRules, parse_rule
    from honing.pipeline.rules import check_config

    docs = (Path(__file__).parents[2] / "docs" / "moe.md").read_text()
    [rule] = [line.strip()[3:-1] for line in docs.splitlines() if "ep/load_imbalance/max >" in line]
    check_config(build_config(BASE | {"monitor.alerts": [rule]}))  # a name runs log
    rules = AlertRules([parse_rule(rule)])
    fired = [rules.observe(step, {"ep/load_imbalance/max": 1.6}) for step in range(1, 11)]
    assert not any(fired[:9]) and fired[9]
