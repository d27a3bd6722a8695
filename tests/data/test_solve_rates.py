"""Prompts chosen by their running solve rate: the raw verdict (not the shaped reward), the
skip rules and where their turn passes, the state a resume restores, and a run that skips
what it solved every time beside DAPO's dynamic sampling."""

import json

import pytest

from honing.backends.launch import train
from honing.data import arithmetic_prompts
from honing.data.solve_rates import SolveRates, is_solved
from honing.data.source import PromptSource
from honing.errors import DataError
from honing.types import Score
from tests.data.test_source import ids, make_prompts
from tests.pipeline._configs import small_run_config


def test_the_verdict_is_the_verifier_s_own_score_not_the_shaped_reward():
    assert is_solved(Score(0.8, details={"base_score": 1.0, "overlong_penalty": -0.2}))
    assert not is_solved(Score(1.0, details={"base_score": 0.0, "format_bonus": 1.0}))
    assert is_solved(Score(1.0)) and not is_solved(Score(0.5))
    assert is_solved(Score(0.0, ok=False, details={"error": "timeout"})) is None


def test_the_rules_apply_once_a_prompt_has_enough_verdicts():
    rates = SolveRates(skip_solved=True, skip_unsolved=True, min_samples=4)
    rates.observe("always", [True, True, None])  # a failed score counts neither way
    rates.observe("never", [False, False, False])
    rates.observe("mixed", [True, False, False, False])
    assert rates.reason("always") is None  # 2 verdicts of the 4 needed
    rates.observe("always", [True, True])
    rates.observe("never", [False])
    assert [rates.reason(p) for p in ("always", "never", "mixed", "unseen")] == [
        "solved",
        "unsolved",
        None,
        None,
    ]
    only_solved = SolveRates(skip_solved=True, skip_unsolved=False, min_samples=1)
    only_solved.load_state_dict(rates.state_dict())
    assert [only_solved.reason(p) for p in ("always", "never")] == ["solved", None]


def test_the_source_passes_over_skipped_prompts_where_their_turn_comes():
    rates = SolveRates(skip_solved=True, skip_unsolved=True, min_samples=1)
    source = PromptSource(make_prompts(5), batch_size=2, seed=0, shuffle=False, solve_rates=rates)
    assert ids(source.next_batch()) == ["p0", "p1"]
    rates.observe("p1", [True])
    rates.observe("p2", [False])
    rates.observe("p4", [True, False])  # mixed: served
    assert ids(source.next_batch()) == ["p3", "p4"]  # p2 passed over
    assert ids(source.next_batch()) == ["p0", "p3"]  # the next epoch: p1 and p2 passed over
    metrics = rates.take_metrics()
    assert metrics == {
        "data/skipped_solved": 1.0,
        "data/skipped_unsolved": 2.0,
        "data/prompts_solved": 1.0,
        "data/prompts_unsolved": 1.0,
    }
    assert rates.take_metrics()["data/skipped_unsolved"] == 0.0  # counted since the last take


def test_a_resumed_source_skips_what_the_uninterrupted_one_skips():
    def source():
        rates = SolveRates(skip_solved=True, skip_unsolved=False, min_samples=1)
        return PromptSource(make_prompts(7), batch_size=3, seed=4, solve_rates=rates)

    whole, first = source(), source()
    for each in (whole, first):
        for _ in range(2):
            served = each.next_batch()
            each.solve_rates.observe(served[0].id, [True])
    state = json.loads(json.dumps(first.state_dict()))  # what the checkpoint's JSON keeps
    assert len(state["solve_rates"]) == 2
    resumed = source()
    resumed.load_state_dict(state)
    assert [ids(resumed.next_batch()) for _ in range(4)] == [
        ids(whole.next_batch()) for _ in range(4)
    ]


def test_skipping_every_prompt_is_one_line_naming_the_keys():
    rates = SolveRates(skip_solved=True, skip_unsolved=True, min_samples=1)
    source = PromptSource(make_prompts(3), batch_size=2, seed=0, solve_rates=rates)
    for prompt in make_prompts(3):
        rates.observe(prompt.id, [prompt.id == "p0"])
    with pytest.raises(DataError) as refused:
        source.next_batch()
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("every one of the 3 training prompts is skipped (1 always solved")
    assert "data.skip_solved / data.skip_unsolved" in message


# solved every time: the prompts whose answers REWARDED holds, whatever the response; the
# others are solved by half the responses (by their characters: groups of mixed rewards,
# which DAPO keeps)
SOLVE_BY_PROMPT = """
REWARDED = {rewarded!r}

def solve_by_prompt(response, ground_truth, **context):
    if str(ground_truth) in REWARDED:
        return 1.0
    return float(sum(map(ord, response)) % 2)
"""


@pytest.mark.slow
def test_a_run_skips_what_it_solved_every_time_and_resumes_the_counts(tmp_path, micro_model_dir):
    """Six prompts, batches of two: in the second epoch the two always-solved ones are passed
    over (DAPO's dynamic sampling on); a run resumed after step 4 logs what the
    uninterrupted one does."""
    prompts = arithmetic_prompts("train", 6, 0, max_digits=2)
    rewarded = sorted(str(p.ground_truth) for p in prompts[:2])
    path = tmp_path / "solve_by_prompt.py"
    path.write_text(SOLVE_BY_PROMPT.format(rewarded=rewarded))
    values = {
        "data.train_size": 6,
        "data.skip_solved": True,
        "algorithm.dynamic_sampling": True,
        "algorithm.max_gen_rounds": 2,
        "trainer.seed": 0,
        "checkpoint.every": 1,
    }

    def run(name, steps, resume="never"):
        config = small_run_config(
            micro_model_dir, f"{path}:solve_by_prompt", **values, **{"trainer.total_steps": steps}
        )
        train(config, tmp_path / name, resume=resume, log=lambda message: None)
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return {m["step"]: m for m in map(json.loads, lines) if m["step"] >= 1}

    whole = run("whole", 6)
    skipped = [whole[step]["data/skipped_solved"] for step in range(1, 7)]
    assert sum(skipped) >= 2 and whole[6]["data/prompts_solved"] >= 2
    assert all(whole[step]["data/skipped_unsolved"] == 0 for step in whole)  # the rule is off
    run("resumed", 4)
    resumed = run("resumed", 6, resume="auto")
    for step in (5, 6):
        for key in ("data/skipped_solved", "data/prompts_solved", "critic/score/mean"):
            assert resumed[step][key] == whole[step][key], (step, key)
