"""``honing train`` under torchrun with ``trainer.sequence_parallel=2``: two CPU ranks share
every sequence (one data-parallel slot) through the whole loop (the reference's and the
update's passes, weight sync, checkpoints) and train the steps one process does."""

import pytest

from .test_data_parallel_run import COMPARED, assert_same_moves, initial_weights, train

SEQUENCE_PARALLEL = {"trainer.sequence_parallel": 2, "pipeline.spread_generation": False}


@pytest.mark.slow
def test_two_ranks_sharing_each_sequence_train_the_steps_one_process_does(
    tmp_path, micro_model_dir, digit_reward
):
    args = (micro_model_dir, digit_reward)
    one, one_weights = train(tmp_path, "one", *args, ranks=1, steps=2)
    two, two_weights = train(tmp_path, "two", *args, ranks=2, steps=2, **SEQUENCE_PARALLEL)
    assert len(one) == len(two) == 2
    for a, b in zip(one, two, strict=True):
        assert a["critic/score/mean"] == b["critic/score/mean"]  # the same batch
        assert b["perf/token_imbalance"] == 1.0  # one slot: both ranks ran every row
        assert 0 < b["memory/activation_peak_mb"] < a["memory/activation_peak_mb"]
        for key in COMPARED:
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    assert_same_moves(two_weights, one_weights, initial_weights(micro_model_dir))
