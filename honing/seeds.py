"""Every seed a run derives, in one place: each is a pure function of the run's seed and a
position (step, task, prompt), never of history, so that a resumed run, another number of
workers or ranks, or another schedule samples exactly what an uninterrupted run does.
"""

from __future__ import annotations

VALIDATION_STEP = -1  # validation samples with the seed of this pseudo-step, at every step
CRITIC_OFFSET = 1  # the critic's mini-batch shuffle: the step's seed + 1 (the policy's: + 0)


def step_seed(seed: int, step: int) -> int:
    """The sampling seed of training step ``step``: also its update's shuffling seed."""
    return (seed * 1_000_003 + step * 7919) % (2**63)


def round_seed(seed: int, round_index: int) -> int:
    """A step's generation round ``round_index`` (dynamic sampling draws several) samples
    with its step's seed plus the round."""
    return seed + round_index


def validation_seed(seed: int) -> int:
    """The sampling seed of every validation pass (the same prompts sampled the same way)."""
    return step_seed(seed, VALIDATION_STEP)


def task_seed(seed: int, start: int) -> int:
    """The seed of a rollout task whose first prompt is the call's ``start``-th: a task's
    samples do not depend on which worker or rank runs it."""
    return (seed * 1_000_003 + start) % (2**63)


def request_seed(seed: int, index: int, samples: int = 1) -> int:
    """A completion request's seed for a vLLM-style engine (31 bits, what servers accept).
    vLLM seeds the k-th of a request's ``samples`` with ``seed + k``: requests are spaced
    ``samples`` apart so that no two samples of a call share a random stream."""
    return (seed * 1_000_003 + index * samples) % (2**31)
