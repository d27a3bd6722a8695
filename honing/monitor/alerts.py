"""Alert rules: conditions on the step metrics, each with the actions to take when it fires.

A rule is one line (``monitor.alerts`` is a list of them)::

    CONDITION [for N steps] -> ACTION[, ACTION ...]

Conditions:

- ``METRIC > X`` (also ``<``, ``>=``, ``<=``): e.g. ``actor/entropy < 0.05``,
  ``response_length/mean > 400``, ``reward/latency_p99_ms > 2000``;
- ``METRIC falls N`` / ``METRIC rises N``: N decreases (increases) in a row, e.g.
  ``critic/score/mean falls 5``;
- ``nonfinite``: any metric of the step is NaN or infinite;
- ``no step for N s``: the watchdog saw no finished step for N seconds (actions ``log`` and
  ``webhook`` only: the stuck loop cannot act).

``for N steps`` needs the condition on N logged values in a row. Steps that do not log the
metric (``val/*`` between validations) neither count nor break a streak. A rule that fired
starts counting again from zero.

Actions: ``log`` (an ``alert`` event in ``events.jsonl`` and the console, which every firing
gets anyway), ``webhook`` (POST the firing as JSON to ``monitor.webhook_url``, in the
background), ``stop`` (checkpoint, then exit with status 3), ``rollback`` (reload the newest
checkpoint from before the condition began and continue; ``rollback(lr_scale=0.5,
temperature=0.8, kl_coef=0.01)`` also changes those; at most ``monitor.max_rollbacks`` times,
then it stops).
"""

from __future__ import annotations

import json
import math
import operator
import re
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from honing.config.values import check_value
from honing.errors import ConfigError
from honing.monitor.names import closest_metric, known_metric

ACTIONS = ("log", "webhook", "stop", "rollback")
ROLLBACK_ARGS = ("lr_scale", "temperature", "kl_coef")
ROLLBACK_KEYS = {"temperature": "rollout.temperature", "kl_coef": "algorithm.kl_coef"}
STOP_EXIT_STATUS = 3

_COMPARE = {">": operator.gt, "<": operator.lt, ">=": operator.ge, "<=": operator.le}
_THRESHOLD_RE = re.compile(
    r"^([\w/@.\-]+)\s*(>=|<=|>|<)\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?)$"
)
_TREND_RE = re.compile(r"^([\w/@.\-]+)\s+(falls|rises)\s+(\d+)(?:\s+steps?)?$")
_STALL_RE = re.compile(r"^no step for\s+(\d+(?:\.\d+)?)\s*(s|sec|seconds|min|minutes)$")
_FOR_RE = re.compile(r"^(.*?)\s+for\s+(\d+)\s+steps?$")
_ACTION_RE = re.compile(r"^(\w+)(?:\((.*)\))?$")


@dataclass(frozen=True)
class Rule:
    """One parsed alert rule (see the module docstring)."""

    text: str
    kind: str  # threshold | falls | rises | nonfinite | stall
    actions: tuple[str, ...]
    metric: str = ""
    op: str = ""
    threshold: float = 0.0
    count: int = 1  # values in a row the condition needs
    stall_s: float = 0.0
    rollback: dict[str, float] = field(default_factory=dict)


@dataclass
class Firing:
    """A rule that fired at ``step``; ``good_step`` is the last step before its condition
    began (what a rollback returns to, at most)."""

    rule: Rule
    step: int
    good_step: int
    values: dict[str, Any]

    def event(self) -> dict[str, Any]:
        return {
            "rule": self.rule.text,
            "step": self.step,
            "good_step": self.good_step,
            "actions": list(self.rule.actions),
            "values": self.values,
        }


def parse_rule(text: str) -> Rule:
    """Parse one rule line.

    Raises:
        ConfigError: naming the rule and what is expected.
    """
    condition, arrow, actions_text = text.partition("->")
    if not arrow or not actions_text.strip():
        raise ConfigError(f"monitor.alerts: {text!r} has no '-> action'; {_FORM}")
    actions, rollback = _parse_actions(text, actions_text)
    condition = " ".join(condition.split())
    count = 1
    if match := _FOR_RE.match(condition):
        condition, count = match.group(1), int(match.group(2))
    common = {"text": text.strip(), "actions": actions, "rollback": rollback}
    if condition == "nonfinite":
        return Rule(kind="nonfinite", count=count, **common)
    if match := _STALL_RE.match(condition):
        seconds = float(match.group(1)) * (60 if match.group(2).startswith("min") else 1)
        if set(actions) - {"log", "webhook"}:
            raise ConfigError(f"monitor.alerts: {text!r}: a stall can only log or webhook")
        return Rule(kind="stall", stall_s=seconds, **common)
    if match := _THRESHOLD_RE.match(condition):
        metric, op, value = match.groups()
        _check_metric(text, metric)
        return Rule(
            kind="threshold", metric=metric, op=op, threshold=float(value), count=count, **common
        )
    if match := _TREND_RE.match(condition):
        metric, direction, steps = match.groups()
        _check_metric(text, metric)
        if int(steps) < 1:
            raise ConfigError(f"monitor.alerts: {text!r}: falls/rises needs N >= 1")
        return Rule(kind=direction, metric=metric, count=int(steps), **common)
    raise ConfigError(
        f"monitor.alerts: cannot read the condition {condition!r} in {text!r}; {_FORM}"
    )


_FORM = (
    "expected 'METRIC > X [for N steps] -> action', 'METRIC falls N -> action', "
    "'nonfinite -> action' or 'no step for N s -> action', actions: " + ", ".join(ACTIONS)
)


def _parse_actions(text: str, actions_text: str) -> tuple[tuple[str, ...], dict[str, float]]:
    actions, rollback = [], {}
    for part in re.split(r",\s*(?![^()]*\))", actions_text.strip()):
        match = _ACTION_RE.match(part.strip())
        if not match or match.group(1) not in ACTIONS:
            raise ConfigError(
                f"monitor.alerts: unknown action {part.strip()!r} in {text!r}; "
                f"choose from {', '.join(ACTIONS)}"
            )
        name, args = match.groups()
        if args is not None and name != "rollback":
            raise ConfigError(f"monitor.alerts: {name} takes no arguments in {text!r}")
        for arg in filter(None, (a.strip() for a in (args or "").split(","))):
            key, value = _rollback_arg(text, arg)
            rollback[key] = value
        actions.append(name)
    return tuple(dict.fromkeys(actions)), rollback


def _rollback_arg(text: str, arg: str) -> tuple[str, float]:
    """One ``key=value`` of ``rollback(...)``, checked as the setting it changes: the
    temperature and KL coefficient as their config keys, the learning-rate scale in (0, 1]
    (a rollback slows the run down; 0 would stop it learning)."""
    key, _, value = (part.strip() for part in arg.partition("="))
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if key not in ROLLBACK_ARGS or not math.isfinite(number):
        raise ConfigError(
            f"monitor.alerts: rollback argument {arg!r} in {text!r}; expected "
            f"{'/'.join(ROLLBACK_ARGS)}=<number>"
        )
    if key == "lr_scale" and not 0 < number <= 1:
        raise ConfigError(
            f"monitor.alerts: rollback argument {arg!r} in {text!r}; lr_scale multiplies the "
            "learning rate: expected 0 < lr_scale <= 1"
        )
    if key in ROLLBACK_KEYS:
        try:
            check_value(ROLLBACK_KEYS[key], number)
        except ConfigError as err:
            raise ConfigError(
                f"monitor.alerts: rollback argument {arg!r} in {text!r}: {err}"
            ) from None
    return key, number


def _check_metric(text: str, metric: str) -> None:
    """A rule's metric is one a run logs (a typo would never fire)."""
    if known_metric(metric):
        return
    near = closest_metric(metric)
    hint = f"did you mean {near}? " if near else ""
    raise ConfigError(
        f"monitor.alerts: {text!r} watches {metric!r}, which no run logs; {hint}"
        "(the metric names: docs/monitoring.md)"
    )


class AlertRules:
    """Evaluates the rules on each step's metrics and says which fired."""

    def __init__(self, rules: list[Rule]) -> None:
        self.rules = [r for r in rules if r.kind != "stall"]
        self._streaks: list[list[tuple[int, float]]] = [[] for _ in self.rules]

    def reset(self) -> None:
        """Forget every streak (after a rollback)."""
        self._streaks = [[] for _ in self.rules]

    def observe(self, step: int, metrics: dict[str, float]) -> list[Firing]:
        """The rules that fire with this step's metrics (streaks updated)."""
        fired = []
        for rule, streak in zip(self.rules, self._streaks, strict=True):
            value = _value(rule, metrics)
            if value is None:
                continue  # not logged this step: neither counts nor breaks a streak
            if rule.kind in ("falls", "rises"):
                moved = streak and (
                    value < streak[-1][1] if rule.kind == "falls" else value > streak[-1][1]
                )
                if not moved:
                    streak.clear()
                streak.append((step, value))
                if len(streak) > rule.count:  # the start value, then `count` moves
                    fired.append(Firing(rule, step, streak[0][0], _values(rule, streak, metrics)))
                    del streak[:-1]  # the current value starts the next trend
                continue
            if not _holds(rule, value):
                streak.clear()
                continue
            streak.append((step, value))
            if len(streak) >= rule.count:
                fired.append(Firing(rule, step, streak[0][0] - 1, _values(rule, streak, metrics)))
                streak.clear()
        return fired


def _value(rule: Rule, metrics: dict[str, Any]) -> float | None:
    """The number the rule looks at this step; ``None`` when the step does not log it."""
    if rule.kind == "nonfinite":
        return float(sum(_is_nonfinite(v) for v in metrics.values()))
    value = metrics.get(rule.metric)
    if value is None or _is_nonfinite(value):
        return None
    return float(value)


def _holds(rule: Rule, value: float) -> bool:
    if rule.kind == "nonfinite":
        return value > 0
    return _COMPARE[rule.op](value, rule.threshold)


def _is_nonfinite(value: Any) -> bool:
    return isinstance(value, float) and not math.isfinite(value)


def _values(rule: Rule, streak: list[tuple[int, float]], metrics: dict) -> dict[str, Any]:
    if rule.kind == "nonfinite":
        return {"nonfinite": sorted(k for k, v in metrics.items() if _is_nonfinite(v))}
    return {rule.metric: {str(step): value for step, value in streak}}


class Watchdog:
    """Fires the stall rules when no step finished for their time (a daemon thread)."""

    def __init__(self, rules: list[Rule], fire: Callable[[Rule, float], None]) -> None:
        self.rules = [r for r in rules if r.kind == "stall"]
        self._fire = fire
        self._last = time.monotonic()
        self._fired: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        if self.rules:
            self._thread.start()

    def beat(self) -> None:
        """A step finished."""
        self._last = time.monotonic()
        self._fired.clear()

    def _watch(self) -> None:
        period = max(0.05, min(r.stall_s for r in self.rules) / 10)
        while not self._stop.wait(period):
            idle = time.monotonic() - self._last
            for index, rule in enumerate(self.rules):
                if idle >= rule.stall_s and index not in self._fired:
                    self._fired.add(index)
                    self._fire(rule, idle)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)


def post_webhook(url: str, payload: dict[str, Any], on_error: Callable[[str], None]) -> None:
    """POST ``payload`` as JSON to ``url`` in a background thread (5 s timeout); a failure is
    reported through ``on_error`` and never reaches the training loop."""

    def send() -> None:
        body = json.dumps(payload, default=str).encode()
        request = urllib.request.Request(
            url, data=body, method="POST", headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=5) as answer:
                answer.read()
        except Exception as exc:  # noqa: BLE001 - a webhook must never stop training
            on_error(f"{type(exc).__name__}: {exc}")

    threading.Thread(target=send, daemon=True).start()
