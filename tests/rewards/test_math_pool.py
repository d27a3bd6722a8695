"""math-verify in killable worker processes: verdicts, deadlines, replacement, batches."""

import pytest

from honing.rewards.math.pool import MathPool
from honing.rewards.math.verifier import MathVerifier

RUNAWAY = "$9^{9^{9^{9}}}$"
# The deadline cuts a runaway short and leaves an honest check (0.1-0.2 s here) 15 times its
# time: 1 s was not enough on a loaded machine (seen: \log_2 16 timed out). The kill-latency
# bound is a timing: the module runs alone.
DEADLINE_S = 3.0
pytestmark = pytest.mark.alone


@pytest.fixture(scope="module")
def pool():
    with MathPool(workers=2, timeout_s=DEADLINE_S) as math_pool:
        yield math_pool


def test_verdicts(pool):
    results = pool.check(
        [
            (["$\\sin x$"], "$\\sin(x)$"),
            (["$3$"], "$\\log_2 16$"),
            (["$2$", "$3$"], "$\\log_2 8$"),  # any of several ground truths
            (["$3$"], ""),
        ]
    )
    assert [r["verdict"] for r in results] == ["correct", "wrong", "correct", "unparsable"]


def test_runaway_is_killed_within_a_second_of_its_deadline(pool):
    [result] = pool.check([(["$1$"], RUNAWAY)])
    assert result["verdict"] == "timeout"
    overshoot = result["elapsed_s"] - pool.timeout_s
    assert 0 <= overshoot < 1.0
    assert [r["verdict"] for r in pool.check([(["$1$"], "$1$")])] == ["correct"]  # replaced


def test_runaways_do_not_block_other_checks(pool):
    jobs = [(["$1$"], RUNAWAY), (["$\\cos 0$"], "$1$"), (["$1$"], RUNAWAY), (["$2$"], "$2$")]
    verdicts = [r["verdict"] for r in pool.check(jobs)]
    assert verdicts == ["timeout", "correct", "timeout", "correct"]


def test_close_stops_the_workers():
    math_pool = MathPool(workers=1, timeout_s=5.0)
    math_pool.check([(["$1$"], "$1$")])
    processes = [worker.process for worker in math_pool._workers]
    math_pool.close()
    assert processes and not any(process.is_alive() for process in processes)
    assert math_pool.check([(["$1$"], "$2$")])[0]["verdict"] == "wrong"  # restarts lazily
    math_pool.close()


def test_score_batch_keeps_order_and_isolates_bad_items():
    items = [
        {"response": "\\boxed{\\sin(x)}", "ground_truth": "\\sin x", "extra_info": {}},
        {"response": "\\boxed{5}", "ground_truth": "5", "data_source": "math"},
        {"ground_truth": "5"},  # no response: a malformed item
        {"response": "\\boxed{9^{9^{9^{9}}}}", "ground_truth": "1"},
        {"response": "\\boxed{4}", "ground_truth": "5"},
    ]
    with MathVerifier(workers=2, timeout_s=DEADLINE_S) as verifier:
        results = verifier.score_batch(items)
    assert [(r["verdict"], r["path"]) for r in results] == [
        ("correct", "slow"),
        ("correct", "fast"),
        ("unparsable", "fast"),
        ("timeout", "slow"),
        ("wrong", "fast"),
    ]
    assert [r["score"] for r in results] == [1.0, 1.0, 0.0, 0.0, 0.0]
