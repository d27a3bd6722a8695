"""``trainer.tensor_parallel``: ``honing train`` on two torchrun ranks that split the policy,
its reference and the critic trains what one process trains, exports the same Hugging Face
weights, and its checkpoint resumes in one process; what it does not combine with is one
line before anything loads."""

import pytest
import torch
from safetensors.torch import load_file

from honing.config import build_config
from honing.errors import ConfigError
from honing.pipeline.rules import check_config

from ._configs import BASE
from .test_data_parallel_run import assert_same_moves, initial_weights
from .test_sharded_run import PPO, _tied, run

TP = {"trainer.tensor_parallel": 2}


def _export(tmp_path, name: str, step: int) -> dict[str, torch.Tensor]:
    return load_file(tmp_path / name / "checkpoints" / f"step_{step}" / "model.safetensors")


@pytest.mark.slow
def test_tensor_parallel_ranks_train_what_one_process_does_and_resume_in_one(
    tmp_path, micro_model_dir, digit_reward
):
    """PPO with a KL reference: step 1 on two ranks splitting every module (checkpoint: the
    policy gathered into Hugging Face files, the critic and the optimizers' slices in shards),
    step 2 resumed in one process; each step's export where an uninterrupted process's is."""
    args = (micro_model_dir, digit_reward)
    kl = PPO | {"algorithm.kl_coef": 0.05, "trainer.critic_warmup_steps": 0}
    whole, whole_weights, _ = run(tmp_path, "whole", *args, 1, 2, strategy="replicate", **kl)
    split, _, _ = run(tmp_path, "hops", *args, 2, 1, strategy="replicate", **kl | TP)
    assert split[0]["critic/score/mean"] == whole[0]["critic/score/mean"]  # the same samples
    assert split[0]["dist/world_size"] == 2.0
    before = initial_weights(micro_model_dir)
    pairs = [(_export(tmp_path, "hops", 1), _export(tmp_path, "whole", 1))]
    resumed, weights, _ = run(tmp_path, "hops", *args, 1, 2, strategy="replicate", **kl)
    assert [m["step"] for m in resumed] == [1, 2]
    for got, want in pairs + [(weights, whole_weights)]:
        assert_same_moves(_tied(got), _tied(want), before)
        assert max(float((got[name] - want[name]).abs().max()) for name in want) < 1e-4


@pytest.mark.parametrize(
    "values, ranks, message",
    [
        ({}, 1, "trainer.tensor_parallel=2 needs torchrun ranks to split each weight; launch "),
        ({}, 3, "trainer.tensor_parallel=2: 3 torchrun ranks do not split into groups of 2;"),
        (
            {"trainer.sequence_parallel": 2},
            4,
            "trainer.tensor_parallel=2 does not combine with trainer.sequence_parallel=2 yet",
        ),
        ({"model.lora_rank": 4}, 2, "does not combine with model.lora_rank=4 yet"),
        ({"memory.dynamic_offload": True}, 2, "with memory.dynamic_offload=true yet"),
        # 6 ranks are 3 slots of 2, which 2 sequences cannot share
        ({"rollout.batch_size": 1, "rollout.group_size": 2}, 6, "2 sequences .* shared by 3 "),
    ],
)
def test_what_tensor_parallelism_does_not_take_is_one_line(values, ranks, message):
    with pytest.raises(ConfigError, match=message) as refused:
        check_config(build_config(BASE | TP | values), world_size=ranks)
    assert "\n" not in str(refused.value)
    check_config(build_config(BASE | TP), world_size=4)  # 2 slots of 2 ranks
