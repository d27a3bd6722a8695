"""Prompts chosen by how often they are solved (``data.skip_solved``, ``data.skip_unsolved``).

A prompt whose samples are all right teaches a group-baseline algorithm nothing (every
advantage is 0), and so does one whose samples are all wrong; generating them costs a step's
time all the same. Each prompt's running solve rate is counted from its raw verdicts: a
sample is solved when its verifier's own score (``details["base_score"]``, else the reward
before any shaping: no overlong or tool penalty, no format bonus) is at least 1, as
``val/accuracy`` counts it; a failed score counts neither way. Once a prompt has
``min_samples`` verdicts, ``skip_solved`` skips it while every one of them was solved and
``skip_unsolved`` while none was; the source then serves the next prompt of the epoch in its
place. The counts are part of the data cursor (``PromptSource.state_dict``), so a resumed run
skips what the uninterrupted one would have.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

REASONS = ("solved", "unsolved")


def is_solved(score) -> bool | None:
    """Whether a ``Score``'s raw verdict is a solve (None: the score failed)."""
    if not score.ok:
        return None
    return float(score.details.get("base_score", score.reward)) >= 1.0


class SolveRates:
    """Each prompt's solved and scored sample counts, and the skip rules on them.

    Args:
        skip_solved: skip a prompt every one of whose verdicts was a solve.
        skip_unsolved: skip a prompt none of whose verdicts was.
        min_samples: the verdicts a prompt needs before either rule applies to it.
    """

    def __init__(self, skip_solved: bool, skip_unsolved: bool, min_samples: int) -> None:
        self.skip_solved, self.skip_unsolved = skip_solved, skip_unsolved
        self.min_samples = max(1, min_samples)
        self._counts: dict[str, list[int]] = {}  # prompt id -> [solved, scored]
        self._skipped: Counter = Counter()  # reason -> prompts skipped since the last take
        self._lock = threading.Lock()  # observed by the producer, saved by the trainer

    @property
    def active(self) -> bool:
        return self.skip_solved or self.skip_unsolved

    def observe(self, prompt_id: str, verdicts: list[bool | None]) -> None:
        """Counts a group's verdicts (``is_solved`` of each sample) for ``prompt_id``."""
        known = [v for v in verdicts if v is not None]
        if not known:
            return
        with self._lock:
            counts = self._counts.setdefault(prompt_id, [0, 0])
            counts[0] += sum(known)
            counts[1] += len(known)

    def reason(self, prompt_id: str) -> str | None:
        """Why ``prompt_id`` is skipped now (``"solved"`` or ``"unsolved"``), else None."""
        with self._lock:
            solved, scored = self._counts.get(prompt_id, (0, 0))
        if scored < self.min_samples:
            return None
        if self.skip_solved and solved == scored:
            return "solved"
        if self.skip_unsolved and solved == 0:
            return "unsolved"
        return None

    def skipped(self, reason: str) -> None:
        with self._lock:
            self._skipped[reason] += 1

    def take_metrics(self) -> dict[str, float]:
        """``data/skipped_solved`` and ``data/skipped_unsolved``: the prompts each rule skipped
        since the last take; ``data/prompts_solved`` and ``data/prompts_unsolved``: the
        prompts each rule would skip now."""
        with self._lock:
            skipped, self._skipped = self._skipped, Counter()
            counted = [c for c in self._counts.values() if c[1] >= self.min_samples]
        out = {f"data/skipped_{reason}": float(skipped[reason]) for reason in REASONS}
        out["data/prompts_solved"] = float(sum(s == n for s, n in counted))
        out["data/prompts_unsolved"] = float(sum(s == 0 for s, _ in counted))
        return out

    def state_dict(self) -> dict[str, Any]:
        with self._lock:
            return {prompt_id: list(counts) for prompt_id, counts in self._counts.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self._lock:
            self._counts = {str(k): [int(v[0]), int(v[1])] for k, v in state.items()}
