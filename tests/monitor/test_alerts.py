"""Alert rules: parsing, and when each kind of condition fires (hand-made metric streams)."""

import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from honing.errors import ConfigError
from honing.monitor.alerts import AlertRules, Watchdog, parse_rule, post_webhook


def _run(rule_text, stream):
    """Feed ``[(step, metrics)]``; return ``[(step, good_step)]`` of each firing."""
    rules = AlertRules([parse_rule(rule_text)])
    return [(f.step, f.good_step) for step, m in stream for f in rules.observe(step, m)]


def test_parse_forms_and_actions():
    rule = parse_rule(
        "actor/entropy < 0.05 for 3 steps -> log, rollback(lr_scale=0.5, kl_coef=0.01)"
    )
    assert (rule.kind, rule.metric, rule.op, rule.threshold, rule.count) == (
        "threshold",
        "actor/entropy",
        "<",
        0.05,
        3,
    )
    assert rule.actions == ("log", "rollback")
    assert rule.rollback == {"lr_scale": 0.5, "kl_coef": 0.01}
    assert parse_rule("critic/score/mean falls 5 -> stop").kind == "falls"
    assert parse_rule("nonfinite -> stop").kind == "nonfinite"
    assert parse_rule("no step for 2 min -> webhook").stall_s == 120.0
    assert parse_rule("val/pass@8 <= 0.5 -> log").metric == "val/pass@8"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("actor/entropy < 0.05", "no '-> action'"),
        ("actor/entropy < 0.05 -> explode", "unknown action 'explode'"),
        ("actor/entropy about 3 -> log", "cannot read the condition"),
        ("no step for 5 s -> rollback", "a stall can only log or webhook"),
        ("actor/lr > 1 -> rollback(lr=2)", "rollback argument 'lr=2'"),
        ("actor/lr > 1 -> stop(now)", "stop takes no arguments"),
        # each rollback setting within what its config key allows
        ("actor/lr > 1 -> rollback(temperature=0)", r"rollout.temperature: 0.0 .* must be > 0"),
        ("actor/lr > 1 -> rollback(kl_coef=-1)", r"algorithm.kl_coef: -1.0 .* must be >= 0"),
        ("actor/lr > 1 -> rollback(lr_scale=0)", r"expected 0 < lr_scale <= 1"),
        ("actor/lr > 1 -> rollback(lr_scale=1e300)", r"expected 0 < lr_scale <= 1"),
        ("actor/lr > 1 -> rollback(lr_scale=nan)", r"lr_scale=nan"),
        # a metric no run logs would never fire
        (
            "actor/ppo_kll > 1 -> stop",
            r"'actor/ppo_kll', which no run logs; did you mean actor/ppo_kl\?",
        ),
        ("reward/mean falls 3 -> log", r"'reward/mean', which no run logs"),
    ],
)
def test_bad_rules_say_what_is_wrong(text, message):
    with pytest.raises(ConfigError, match=message):
        parse_rule(text)


def test_threshold_for_n_steps_needs_a_streak_and_re_arms():
    values = [5, 1, 1, 5, 1, 1, 1, 1]
    stream = [(s, {"actor/grad_norm": v}) for s, v in enumerate(values, start=1)]
    # below 2 on steps 2-3 (fires at 3, good step 1), then 5-6 (fires at 6), then 7-8 again
    assert _run("actor/grad_norm < 2 for 2 steps -> log", stream) == [(3, 1), (6, 4), (8, 6)]


def test_missing_metric_neither_counts_nor_breaks_a_streak():
    stream = [(1, {"val/accuracy": 0.3}), (2, {}), (3, {"val/accuracy": 0.2}), (4, {})]
    assert _run("val/accuracy < 0.5 for 2 steps -> log", stream) == [(3, 0)]


def test_falls_counts_consecutive_decreases_from_the_peak():
    values = [0.5, 0.6, 0.55, 0.5, 0.45, 0.46, 0.4]
    stream = [(s, {"critic/score/mean": v}) for s, v in enumerate(values, start=1)]
    # peak 0.6 at step 2, three falls to step 5: fires at 5 with good step 2 (the peak)
    assert _run("critic/score/mean falls 3 -> rollback", stream) == [(5, 2)]


def test_equal_values_break_a_trend():
    stream = [(s, {"critic/score/mean": v}) for s, v in enumerate([3, 2, 2, 1], start=1)]
    assert _run("critic/score/mean falls 2 -> log", stream) == []


def test_nonfinite_fires_on_any_nan_metric_and_names_it():
    rules = AlertRules([parse_rule("nonfinite -> stop")])
    assert rules.observe(1, {"a": 1.0, "b": 2.0}) == []
    [firing] = rules.observe(2, {"a": math.nan, "b": math.inf})
    assert firing.values == {"nonfinite": ["a", "b"]} and firing.good_step == 1


def test_watchdog_fires_once_per_stall():
    fired = []
    dog = Watchdog([parse_rule("no step for 0.2 s -> log")], lambda rule, idle: fired.append(idle))
    time.sleep(0.5)
    assert len(fired) == 1 and fired[0] >= 0.2
    dog.beat()
    time.sleep(0.1)
    assert len(fired) == 1
    dog.close()


def test_webhook_posts_json_and_reports_failures():
    received = []

    class Hook(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    errors = []
    post_webhook(f"http://127.0.0.1:{server.server_address[1]}/", {"rule": "r"}, errors.append)
    post_webhook("http://127.0.0.1:9/", {"rule": "r"}, errors.append)
    deadline = time.monotonic() + 5
    while (not received or not errors) and time.monotonic() < deadline:
        time.sleep(0.01)
    server.shutdown()
    assert received == [{"rule": "r"}]
    assert len(errors) == 1 and "URLError" in errors[0]
