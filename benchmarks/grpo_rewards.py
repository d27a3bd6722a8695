"""The reward of the TRL side-by-side benchmark (benchmarks/grpo_step.py), in honing's form.

The same rule as the peer script's ``correct_answer_reward`` (../shared/peers/trl_grpo_bench.py):
1.0 iff the completion starts (after optional whitespace) with an integer equal to the answer.
Given to honing as ``reward.function=benchmarks/grpo_rewards.py:starts_with_answer``.
"""

from __future__ import annotations

import re

_LEADING_INT = re.compile(r"\s*(-?\d+)")


def starts_with_answer(response: str, ground_truth, **_: object) -> float:
    """1.0 if ``response``'s leading integer equals ``ground_truth``, else 0.0."""
    match = _LEADING_INT.match(response)
    return 1.0 if match is not None and match.group(1) == str(ground_truth) else 0.0
