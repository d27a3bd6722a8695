"""The advantage estimators' registry and settings: what each estimator reads, said once.

An estimator is a function ``(scores [N], response_mask [N, T], group_ids [N], *, ...) ->
(advantages [N, T], returns [N, T])``; samples drawn from the same prompt share a group id.
Its keyword arguments are of two kinds, each named when it is registered:

- ``settings``: fields of ``AdvantageSettings`` (``algorithm.gamma``, ``algorithm.lam``,
  ``algorithm.norm_adv_by_std``) it reads;
- ``inputs``: per-batch tensors it takes beyond the scores (``token_rewards``, ``values``,
  ``baseline_scores``, ``distill_rewards``).

The registered ``AdvantageEstimator`` is called the same way for every name, with the
settings passed explicitly, so the trainer never branches on the name::

    advantages, returns = get_advantage(name)(
        scores, response_mask, group_ids, settings,
        token_rewards=..., values=..., baseline_scores=...,
    )

It hands the function the settings it reads and the inputs it takes (an estimator that needs
an input it was not given raises ``ValueError``), and refuses a setting changed from its
default that the estimator does not read, which could have no effect; ``pipeline/rules.py``
makes the same check on the config before anything loads.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, fields

from torch import Tensor

from honing.algorithms.registry import lookup, register

EstimatorFn = Callable[..., tuple[Tensor, Tensor]]

INPUTS = ("token_rewards", "values", "baseline_scores", "distill_rewards")


@dataclass(frozen=True)
class AdvantageSettings:
    """The settings of the advantage estimators; the defaults are the config's."""

    gamma: float = 1.0  # discount per response token (reinforce_plus_plus, gae)
    lam: float = 1.0  # GAE's lambda (gae)
    norm_adv_by_std: bool = True  # divide by the group's std (grpo)
    distill_score_coef: float = 0.0  # distill: the weight of the scores' GRPO advantage


SETTINGS = tuple(f.name for f in fields(AdvantageSettings))


@dataclass(frozen=True)
class AdvantageEstimator:
    """A registered estimator: its function and the settings and inputs it takes."""

    name: str
    fn: EstimatorFn
    settings: tuple[str, ...] = ()
    inputs: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        declared = (("setting", self.settings, SETTINGS), ("input", self.inputs, INPUTS))
        for kind, names, known in declared:
            if unknown := sorted(set(names) - set(known)):
                raise ValueError(
                    f"advantage estimator {self.name!r}: unknown {kind} {', '.join(unknown)}; "
                    f"the {kind}s are {', '.join(known)}"
                )
        # what it declares and the arguments it takes agree (checked once, when registered)
        takes = set(inspect.signature(self.fn).parameters)
        for _, names, known in declared:
            if mismatch := sorted((set(names) ^ takes) & set(known)):
                raise ValueError(
                    f"advantage estimator {self.name!r}: {', '.join(mismatch)} is declared "
                    "but not an argument, or an argument but not declared"
                )

    def unused(self, settings: AdvantageSettings) -> list[str]:
        """The fields of ``settings`` set away from their defaults that this estimator does
        not read."""
        return [
            f.name
            for f in fields(settings)
            if f.name not in self.settings and getattr(settings, f.name) != f.default
        ]

    def __call__(
        self,
        scores: Tensor,
        response_mask: Tensor,
        group_ids: Tensor,
        settings: AdvantageSettings = AdvantageSettings(),
        *,
        token_rewards: Tensor | None = None,
        values: Tensor | None = None,
        baseline_scores: Tensor | None = None,
        distill_rewards: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """The estimator's ``(advantages, returns)``, both ``[N, T]``.

        Raises:
            ValueError: If ``settings`` changes one this estimator does not read, or an input
                it needs is missing.
        """
        if unused := self.unused(settings):
            raise ValueError(f"advantage estimator {self.name!r} does not use {', '.join(unused)}")
        offered = {
            "token_rewards": token_rewards,
            "values": values,
            "baseline_scores": baseline_scores,
            "distill_rewards": distill_rewards,
        }
        return self.fn(
            scores,
            response_mask,
            group_ids,
            **{name: getattr(settings, name) for name in self.settings},
            **{name: offered[name] for name in self.inputs},
        )


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {}


def register_advantage(
    name: str, *, settings: tuple[str, ...] = (), inputs: tuple[str, ...] = ()
) -> Callable[[EstimatorFn], EstimatorFn]:
    """Decorator that adds an estimator to ``ADVANTAGE_ESTIMATORS`` under ``name``, with the
    ``AdvantageSettings`` fields it reads and the ``INPUTS`` it takes (both by the names of
    its keyword arguments). The function itself is returned unchanged.

    Raises:
        ValueError: If ``name`` is already taken, or a setting or input is not one there is.
    """

    def decorator(fn: EstimatorFn) -> EstimatorFn:
        estimator = AdvantageEstimator(name, fn, tuple(settings), tuple(inputs))
        register(ADVANTAGE_ESTIMATORS, "advantage estimator", name)(estimator)
        return fn

    return decorator


def get_advantage(name: str) -> AdvantageEstimator:
    """Returns the estimator registered under ``name``.

    Raises:
        ValueError: If no estimator has that name; the message lists the known ones.
    """
    return lookup(ADVANTAGE_ESTIMATORS, "advantage estimator", name)
