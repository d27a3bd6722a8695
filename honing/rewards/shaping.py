"""Reward shaping that depends on the response, not on its correctness.

``overlong_penalty`` is DAPO's soft overlong punishment (https://arxiv.org/abs/2503.14476,
eq. 13): no penalty up to ``max_length - buffer_len`` tokens, then a penalty growing linearly
to ``-factor`` at ``max_length``, so the policy learns to finish before the hard cut.

``tool_penalty`` charges a multi-turn sample for its tool calls that errored and for calls
beyond a free number, so that the policy learns to call well and not more than it needs.
"""

from __future__ import annotations

from typing import Any


def overlong_penalty(length: int, max_length: int, buffer_len: int, factor: float) -> float:
    """Penalty (<= 0) for a response of ``length`` tokens; 0 when ``buffer_len`` is 0."""
    if buffer_len <= 0:
        return 0.0
    free = max_length - buffer_len
    if length <= free:
        return 0.0
    return -factor * min(1.0, (length - free) / buffer_len)


def tool_penalty(
    calls: list[dict[str, Any]] | None, error_penalty: float, call_penalty: float, free_calls: int
) -> float:
    """Penalty (<= 0) for a sample's tool ``calls`` (``Rollout.tool_calls``): ``error_penalty``
    per call that errored, ``call_penalty`` per call beyond ``free_calls``."""
    if not calls:
        return 0.0
    errors = sum(bool(c["error"]) for c in calls)
    return -error_penalty * errors - call_penalty * max(0, len(calls) - free_calls)
