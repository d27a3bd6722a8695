"""``honing report``: the HTML parses, every chart is drawn from its metrics, gaps are named."""

import json
import math
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest

from honing.backends.launch import train
from honing.errors import UserError
from honing.monitor.plots import MAX_POINTS, downsample, format_number, nice_ticks
from honing.monitor.report import REPORT_FILE, report_main, write_report
from honing.monitor.report_charts import RunData, stacked_bands, stage_times
from tests.pipeline._configs import small_run_config

CHART_TITLES = [
    "Reward (trained samples)",
    "Validation accuracy",
    "Response length (tokens)",
    "Response length distribution (logged samples)",
    "Entropy",
    "KL",
    "Clip fractions",
    "Gradient norm",
    "Time per step",
    "Throughput (tokens/s)",
    "Verifier latency (ms)",
    "Samples per step",
]


class Page(HTMLParser):
    """Collects the cards (title, svg count, data paths, note) and the table rows of a page."""

    def __init__(self) -> None:
        super().__init__()
        self.cards: dict[str, dict] = {}
        self.rows: list[list[str]] = []
        self._card: dict | None = None
        self._in: str | None = None
        self._depth = 0

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        classes = (attrs.get("class") or "").split()
        if tag == "section" and "card" in classes:
            self._card = {"svg": 0, "data": [], "note": "", "title": ""}
        elif self._card is not None and tag == "svg":
            self._card["svg"] += 1
        elif self._card is not None and "data" in classes:
            self._card["data"].append(attrs.get("d") or tag)
        elif self._card is not None and tag == "h3":
            self._in = "title"
        elif self._card is not None and "note" in classes:
            self._in = "note"
        elif tag == "tr":
            self.rows.append([])
        elif tag in ("td", "th"):
            self._in = "cell"

    def handle_endtag(self, tag):
        if tag == "section" and self._card is not None:
            self.cards[self._card["title"]] = self._card
            self._card = None
        if tag in ("h3", "div", "td", "th"):
            self._in = None

    def handle_data(self, data):
        if self._in in ("title", "note") and self._card is not None:
            self._card[self._in] += data
        elif self._in == "cell":
            self.rows[-1].append(data)


def parse(path) -> Page:
    page = Page()
    page.feed(path.read_text(encoding="utf-8"))
    page.close()
    return page


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records))


def step_record(step: int) -> dict:
    """Every metric the report draws, with simple values that depend on the step."""
    return {
        "step": step,
        "time": 1_700_000_000.0 + 2.0 * step,
        "critic/score/mean": 0.1 * step,
        "critic/score/min": 0.0,
        "critic/score/max": 1.0,
        "response_length/mean": 10.0 + step,
        "response_length/max": 20.0 + step,
        "response_length/clip_ratio": 0.0,
        "actor/entropy": 1.0 / step,
        "actor/ppo_kl": 0.01,
        "actor/pg_clipfrac": 0.02,
        "actor/grad_norm": 1.5,
        "timing_s/gen": 0.5,
        "timing_s/reward": 0.1,
        "timing_s/update": 0.3,
        "timing_s/step": 1.0,
        "perf/throughput": 1000.0,
        "reward/latency_p99_ms": 3.0,
        "samples/generated": 8,
        "samples/trained": 8,
    }


@pytest.fixture
def run_dir(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    records = [{"step": 0, "val/accuracy": 0.25, "val/pass@4": 0.5, "time": 1_700_000_000.0}]
    records += [step_record(step) for step in range(1, 11)]
    records[10] |= {"val/accuracy": 0.75, "val/pass@4": 1.0}
    write_jsonl(run / "metrics.jsonl", records)
    write_jsonl(
        run / "samples.jsonl",
        [{"step": s, "prompt": "1+1=", "response": "2" * s, "reward": 1.0} for s in range(1, 11)],
    )
    write_jsonl(
        run / "events.jsonl",
        [
            {"time": 1_700_000_010.0, "kind": "alert", "rule": "entropy < 0.2", "step": 6}
            | {"actions": ["rollback"]},
            {"time": 1_700_000_011.0, "kind": "rollback", "step": 6, "to_step": 4},
        ],
    )
    config = "trainer:\n  total_steps: 10\nrollout:\n  max_new_tokens: 32\n"
    (run / "config.yaml").write_text(config)
    return run


def test_every_chart_drawn_from_hand_made_metrics(run_dir):
    path = write_report(run_dir)
    assert path == run_dir / REPORT_FILE
    page = parse(path)
    assert list(page.cards) == CHART_TITLES
    for title, card in page.cards.items():
        assert card["svg"] == 1, title
        assert card["data"], title
    # The reward line goes through 10 points, the first at step 1: "M<x> <y>" then 9 "L"s.
    reward_line = page.cards["Reward (trained samples)"]["data"][1]
    assert reward_line.startswith("M") and reward_line.count("L") == 9
    html = path.read_text(encoding="utf-8")
    assert "0.25 (step 0) → 0.75 (step 10)" in html  # val/accuracy first → last
    assert "10 of 10" in html and "finished" in html
    assert "limit 32" in html  # rollout.max_new_tokens drawn on the length chart
    # Self-contained: nothing to fetch, nothing to run.
    assert not any(word in html for word in ("<script", "src=", "href=", "@import", "url("))
    # One logged sample per step, of s characters at step s: one full-strength cell per step.
    heat = html.split("<h3>Response length distribution")[1].split("</section>")[0]
    assert heat.count("<rect") == 10 and heat.count('fill-opacity="1.00"') == 10
    assert "y: characters per response" in heat


def test_events_become_rows_and_badges(run_dir):
    path = write_report(run_dir)
    page = parse(path)
    event_rows = [row for row in page.rows if row and row[0].startswith("2023-11-14")]
    assert [row[1] for row in event_rows] == ["alert", "rollback"]
    assert event_rows[0][0] == "2023-11-14 22:13:30"  # 1_700_000_010 s, in UTC
    assert 'rule="entropy < 0.2"' in event_rows[0][2]
    html = path.read_text(encoding="utf-8")
    assert "rollback ×1, last at step 6" in html
    assert "alert ×1 (rollback), last at step 6" in html
    assert html.count('class="event"') == 11  # the step-6 mark on every line chart


def test_missing_metrics_get_a_note_not_a_chart(run_dir):
    records = [{"step": 1, "critic/score/mean": 0.5}, {"step": 2, "critic/score/mean": 0.7}]
    write_jsonl(run_dir / "metrics.jsonl", records)
    page = parse(write_report(run_dir))
    assert page.cards["Reward (trained samples)"]["svg"] == 1
    kl = page.cards["KL"]
    assert kl["svg"] == 0
    assert kl["note"] == "not logged in this run (actor/ppo_kl, actor/kl_loss)"
    assert page.cards["Entropy"]["note"].startswith("not logged in this run")


def test_non_finite_values_break_the_line_and_are_marked(run_dir):
    records = [step_record(step) for step in range(1, 6)]
    records[2]["actor/entropy"] = None  # NaN in the run, written as null
    write_jsonl(run_dir / "metrics.jsonl", records)
    html = write_report(run_dir).read_text(encoding="utf-8")
    entropy = html.split("<h3>Entropy</h3>")[1].split("</section>")[0]
    line = re.search(r'class="data line" d="([^"]+)"', entropy).group(1)
    assert line.count("M") == 2  # two segments around the gap
    assert 'class="nonfinite"' in entropy
    assert "1 non-finite metric values" in html


def test_single_step_empty_file_and_torn_line(run_dir):
    write_jsonl(run_dir / "metrics.jsonl", [step_record(1)])
    page = parse(write_report(run_dir))
    assert page.cards["Entropy"]["svg"] == 1
    (run_dir / "metrics.jsonl").write_text("")
    page = parse(write_report(run_dir))
    assert page.cards["Entropy"]["note"].startswith("not logged")
    (run_dir / "metrics.jsonl").write_text(json.dumps(step_record(1)) + '\n{"step": 2, "act')
    html = write_report(run_dir).read_text(encoding="utf-8")
    assert "1 of 10" in html


def test_long_run_is_downsampled_and_stays_small(run_dir):
    write_jsonl(run_dir / "metrics.jsonl", [step_record(step) for step in range(1, 5001)])
    path = write_report(run_dir)
    assert path.stat().st_size < 250_000
    page = parse(path)
    reward_line = page.cards["Reward (trained samples)"]["data"][1]
    assert reward_line.count("L") + 1 <= MAX_POINTS
    assert "each point: mean of 17 steps" in path.read_text(encoding="utf-8")


def test_report_main_prints_the_path_and_rejects_non_runs(run_dir, tmp_path, capsys):
    assert report_main(str(run_dir)) == 0
    assert capsys.readouterr().out.strip() == str(run_dir / REPORT_FILE)
    with pytest.raises(UserError, match="no such run directory"):
        report_main(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no metrics.jsonl"):
        report_main(str(tmp_path / "empty"))


def test_report_of_a_real_training_run(tmp_path, micro_model_dir, digit_reward):
    config = small_run_config(micro_model_dir, digit_reward, **{"trainer.total_steps": 2})
    train(config, tmp_path / "run", resume="never", log=lambda message: None)
    page = parse(write_report(tmp_path / "run"))
    for title in ("Reward (trained samples)", "Entropy", "Time per step", "Throughput (tokens/s)"):
        assert page.cards[title]["svg"] == 1 and page.cards[title]["data"], title


def test_nice_ticks_and_numbers():
    assert nice_ticks(0, 1, 5) == [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    assert nice_ticks(-0.5, 0.5, 4) == [-0.4, -0.2, 0.0, 0.2, 0.4]
    assert nice_ticks(3, 97, 4) == [20, 40, 60, 80]
    assert [format_number(v) for v in (0, 0.25, 1500, 25000, 3.4e6, 2e-5)] == [
        "0",
        "0.25",
        "1500",
        "25k",
        "3.4M",
        "2e-05",
    ]


def test_downsample_averages_buckets_and_keeps_gaps():
    points = [(1, 1.0), (2, 3.0), (3, None), (4, None), (5, 5.0)]
    assert downsample(points, max_points=3) == [
        (1.5, 2.0, 1.0, 3.0),
        (3.5, None, None, None),
        (5.0, 5.0, 5.0, 5.0),
    ]
    assert downsample(points, max_points=10)[2] == (3.0, None, None, None)
    assert math.isclose(downsample([(s, float(s)) for s in range(1000)], 10)[0][1], 49.5)


def test_the_timing_chart_draws_each_second_once():
    """``prepare`` contains the reference and old-logprob passes: stacked, it counts only the
    rest of itself, so the stack never exceeds the step it explains."""
    record = {"step": 1, "timing_s/gen": 0.4, "timing_s/ref": 0.2, "timing_s/old": 0.1}
    record |= {"timing_s/prepare": 0.35, "timing_s/update": 0.3, "timing_s/sync": 0.0}
    record |= {"timing_s/step": 1.1}
    stages = stage_times(RunData(Path("."), [record], [], []))
    assert stages["prepare"] == {1: pytest.approx(0.05)}
    assert sum(values[1] for values in stages.values()) == pytest.approx(1.05)


def test_a_mixture_of_experts_run_gets_its_routing_chart(run_dir):
    dense = parse(write_report(run_dir))
    assert "Mixture of experts" not in dense.cards  # a dense run: no empty card
    records = [
        step_record(step) | {"moe/load_violation/max": 0.5, "moe/rollout_router_match": 0.9}
        for step in range(1, 4)
    ]
    write_jsonl(run_dir / "metrics.jsonl", records)
    card = parse(write_report(run_dir)).cards["Mixture of experts"]
    assert card["svg"] == 1 and card["data"]


def feature_record(step: int) -> dict:
    """The metrics of tools, partial rollouts, the rollout–trainer check, memory and the
    stale samples of an off-policy schedule."""
    return {
        "tool/calls": 6.0,
        "tool/errors": 1.0,
        "tool/timeouts": 0.0,
        "tool/hung_threads": 0.0,
        "tool/calls_per_sample": 1.5,
        "tool/turns_per_sample": 2.5,
        "tool/latency_s": 0.02 * step,
        "partial/carried_samples": 2.0,
        "partial/multi_version_samples": 1.0,
        "partial/ended_stale": 0.0,
        "partial/tokens_age0": 30.0,
        "partial/tokens_age1": 10.0,
        "partial/kv_kept_tokens": 12.0,
        "rollout_mismatch/prob_diff_mean": 0.001,
        "rollout_mismatch/prob_diff_max": 0.01,
        "rollout_mismatch/logprob_diff_max": 0.05,
        "rollout_mismatch/kl": 0.0002,
        "system/rss_mb": 900.0 + step,
        "samples/stale": 2,
    }


FEATURE_CHARTS = [
    "Tool calls per step",
    "Tool use per sample",
    "Tool call latency (s)",
    "Rollout–trainer probability gap",
    "Rollout–trainer KL and log-prob gap",
    "Memory (MiB)",
    "Partial rollouts: samples",
    "Partial rollouts: token age",
]


def card_html(html: str, title: str) -> str:
    return html.split(f"<h3>{title}</h3>")[1].split("</section>")[0]


def test_tool_partial_mismatch_and_memory_charts_when_the_run_logged_them(run_dir):
    """A run that logged none of them gets no card for them (``run_dir``'s); one that did
    gets a chart of each, and its stale samples in the sample accounting."""
    assert list(parse(write_report(run_dir)).cards) == CHART_TITLES
    records = [step_record(step) | feature_record(step) for step in range(1, 6)]
    write_jsonl(run_dir / "metrics.jsonl", records)

    path = write_report(run_dir)

    page = parse(path)
    assert list(page.cards) == CHART_TITLES + FEATURE_CHARTS
    for title in FEATURE_CHARTS:
        assert page.cards[title]["svg"] == 1 and page.cards[title]["data"], title
    html = path.read_text(encoding="utf-8")
    assert "samples/stale 2" in card_html(html, "Samples per step")  # the last value
    ages = card_html(html, "Partial rollouts: token age")
    assert "0 versions behind" in ages and "1 version behind" in ages
    assert "partial/kv_kept_tokens 12" in ages
    assert "tool/latency_s 0.1" in card_html(html, "Tool call latency (s)")
    assert "system/rss_mb 905" in card_html(html, "Memory (MiB)")
    assert "system/gpu_mem_mb" not in card_html(html, "Memory (MiB)")  # not logged: no line


def test_token_ages_are_stacked():
    run = RunData(
        Path("run"),
        metrics=[{"step": 1, "partial/tokens_age0": 30.0, "partial/tokens_age1": 10.0}],
        samples=[],
        events=[],
    )
    bands = stacked_bands({age: dict(run.series(f"partial/tokens_age{age}")) for age in (0, 1)})
    assert [band.points for band in bands] == [[(1, 0.0, 30.0)], [(1, 30.0, 40.0)]]
