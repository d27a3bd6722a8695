"""The coefficient of a KL penalty in the reward: fixed, or adapted toward a target KL.

The adaptive controller is Ziegler et al.'s proportional rule (https://arxiv.org/abs/1909.08593,
section 2.2): ``beta <- beta * (1 + clip(kl / target - 1, -0.2, 0.2) * n / horizon)``, where
``n`` is the number of samples the KL was measured on. Plain floats: its state is one number,
saved in every checkpoint so that a resumed run continues with the same coefficient.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class KLController:
    """``value`` is the current coefficient; ``update`` moves it (adaptive) or not (fixed)."""

    value: float
    kind: str = "fixed"
    target: float = 0.1
    horizon: int = 10000

    def update(self, current_kl: float, samples: int) -> None:
        if self.kind == "fixed":
            return
        if self.kind != "adaptive":
            raise ValueError(f"unknown KL controller {self.kind!r}; choose fixed or adaptive")
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * samples / self.horizon
