"""Reward shaping that depends on the response, not on its correctness.

``overlong_penalty`` is DAPO's soft overlong punishment (https://arxiv.org/abs/2503.14476,
eq. 13): no penalty up to ``max_length - buffer_len`` tokens, then a penalty growing linearly
to ``-factor`` at ``max_length``, so the policy learns to finish before the hard cut.
"""

from __future__ import annotations


def overlong_penalty(length: int, max_length: int, buffer_len: int, factor: float) -> float:
    """Penalty (<= 0) for a response of ``length`` tokens; 0 when ``buffer_len`` is 0."""
    if buffer_len <= 0:
        return 0.0
    free = max_length - buffer_len
    if length <= free:
        return 0.0
    return -factor * min(1.0, (length - free) / buffer_len)
