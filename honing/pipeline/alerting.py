"""What the loop does when an alert rule fires: log, webhook, stop or roll back.

``Alerting`` owns the rules (``monitor.alerts``), the stall watchdog and the webhook; after
each step it records every firing in ``events.jsonl`` (kind ``alert``) and tells the loop the
strongest action to take: ``stop`` beats ``rollback`` beats the rest. A rollback goes to the
newest checkpoint at or before the firing's last good step; checkpoints written after that
step belong to the bad stretch and are set aside under ``checkpoints/abandoned-<time>/``
(kept, but out of reach of ``--resume auto``). With no such checkpoint, or after
``monitor.max_rollbacks`` rollbacks, the rollback becomes a stop.

A rollback's changes accumulate over the run's rollbacks, whichever checkpoint each returns
to: ``lr_scale`` multiplies the scale of the ones before (two halvings give a quarter), and
``temperature`` and ``kl_coef`` replace the values in force. Checkpoints keep them (the scale
with the policy's schedule, the others in ``state.json``), so ``--resume auto`` after a
rollback goes on as the run would have.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from honing.checkpoint import CheckpointManager
from honing.config import MonitorConfig
from honing.errors import ConfigError
from honing.monitor import RunLogger
from honing.monitor.alerts import AlertRules, Firing, Rule, Watchdog, parse_rule, post_webhook


def set_aside_newer(
    checkpoints: CheckpointManager, step: int, log: Callable[[str], None]
) -> list[str]:
    """Checkpoints past ``step`` belong to an abandoned future: keep them, but out of reach of
    ``--resume auto``, under ``checkpoints/abandoned-<time>/``."""
    newer = [s for s in checkpoints.complete_steps() if s > step]
    if not newer:
        return []
    shelf = checkpoints.root / f"abandoned-{time.strftime('%Y%m%d-%H%M%S')}"
    shelf.mkdir(parents=True, exist_ok=True)
    for old in newer:
        os.replace(checkpoints.path_for(old), shelf / f"step_{old}")
    log(f"moved checkpoints of steps {newer} to {shelf}")
    return [str(shelf / f"step_{s}") for s in newer]


def parse_rules(config: MonitorConfig) -> list[Rule]:
    """The configured rules; a webhook action needs ``monitor.webhook_url``.

    Raises:
        ConfigError: a rule does not parse, or webhook without a URL.
    """
    rules = [parse_rule(text) for text in config.alerts]
    if any("webhook" in r.actions for r in rules) and not config.webhook_url:
        raise ConfigError("monitor.alerts: a rule uses 'webhook' but monitor.webhook_url is empty")
    return rules


@dataclass
class Decision:
    """The action the loop takes after a step, with the firing behind it."""

    action: str  # "stop" | "rollback"
    firing: Firing


class Alerting:
    """Rules, watchdog and webhook of one run (module docstring)."""

    def __init__(self, config: MonitorConfig, logger: RunLogger, run_dir: Path) -> None:
        self.config, self.logger, self.run_dir = config, logger, run_dir
        rules = parse_rules(config)
        self.rules = AlertRules(rules)
        self.watchdog = Watchdog(rules, self._stalled)
        self.rollbacks = 0

    def after_step(self, step: int, metrics: dict[str, float]) -> Decision | None:
        """Record this step's firings; the stop or rollback the loop must do, if any."""
        self.watchdog.beat()
        decision = None
        for firing in self.rules.observe(step, metrics):
            self.logger.log_event("alert", **firing.event())
            if "webhook" in firing.rule.actions:
                self._webhook({"kind": "alert", **firing.event()})
            for action in ("stop", "rollback"):
                if action in firing.rule.actions and (
                    decision is None or decision.action == "rollback"
                ):
                    decision = Decision(action, firing)
                    break
        return decision

    def _stalled(self, rule: Rule, idle_s: float) -> None:
        event = {"rule": rule.text, "idle_s": round(idle_s, 1), "actions": list(rule.actions)}
        self.logger.log_event("alert", **event)
        if "webhook" in rule.actions:
            self._webhook({"kind": "alert", **event})

    def _webhook(self, payload: dict) -> None:
        payload = {"run_dir": str(self.run_dir), **payload}
        post_webhook(
            self.config.webhook_url,
            payload,
            lambda reason: self.logger.log_event("webhook_failed", reason=reason),
        )

    def close(self) -> None:
        self.watchdog.close()
