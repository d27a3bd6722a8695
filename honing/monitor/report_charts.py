"""The data of a run directory and the charts of its report (see ``report.py``).

``load_run`` reads ``metrics.jsonl``, ``samples.jsonl``, ``events.jsonl``, ``config.yaml``
and ``summary.json``; each ``*_chart`` function turns it into one ``Chart`` card: an inline
SVG from ``plots.py`` with its legend, or a "not logged in this run" note naming the metrics
that were looked for. Torn or invalid JSONL lines (a crash mid-write) are skipped; a step
logged twice keeps its last record.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from honing.monitor.logger import EVENTS_FILE, METRICS_FILE, SAMPLES_FILE
from honing.monitor.plots import (
    EVENT_COLOR,
    MAX_POINTS,
    NONFINITE_COLOR,
    PALETTE,
    Band,
    Line,
    format_number,
    heat_strip,
    line_chart,
)

HEAT_COLUMNS, HEAT_BINS = 60, 12
MAX_MARKS = 100
# Event kinds that deserve a red badge, a highlighted row and a mark on every chart.
ATTENTION = {"alert", "rollback", "rollback_refused", "stop", "stopped", "crash", "webhook_failed"}
# Stages of a step, stacked in the timing chart. ``prepare`` (make_experience) contains the
# ``ref`` and ``old`` logprob passes: the chart stacks what is left of it.
TIMING_PARTS = ("gen", "reward", "ref", "old", "prepare", "update", "sync")
TOKEN_AGE = "partial/tokens_age"
# Charts of features a run may not use, each drawn only when the run logged one of its
# metrics (y from 0); partial rollouts' token-age chart follows them (``token_age_chart``).
OPTIONAL_CHARTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "Mixture of experts",
        (
            "moe/load_violation/max",
            "moe/load_violation/mean",
            "moe/router_entropy",
            "moe/rollout_router_match",
            "moe/aux_loss",
        ),
    ),
    ("Tool calls per step", ("tool/calls", "tool/errors", "tool/timeouts", "tool/hung_threads")),
    ("Tool use per sample", ("tool/calls_per_sample", "tool/turns_per_sample")),
    ("Tool call latency (s)", ("tool/latency_s",)),
    (
        "Rollout–trainer probability gap",
        ("rollout_mismatch/prob_diff_max", "rollout_mismatch/prob_diff_mean"),
    ),
    (
        "Rollout–trainer KL and log-prob gap",
        ("rollout_mismatch/kl", "rollout_mismatch/logprob_diff_max"),
    ),
    ("Memory (MiB)", ("system/rss_mb", "system/gpu_mem_mb")),
    (
        "Partial rollouts: samples",
        ("partial/carried_samples", "partial/multi_version_samples", "partial/ended_stale"),
    ),
)


@dataclass
class RunData:
    """Everything the report reads from a run directory."""

    run_dir: Path
    metrics: list[dict[str, Any]]  # one record per step, sorted by step
    samples: list[dict[str, Any]]
    events: list[dict[str, Any]]
    config: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)

    def series(self, name: str) -> list[tuple[float, float | None]]:
        """``(step, value)`` for the steps that logged ``name``; ``None`` = not finite."""
        return [(record["step"], number(record[name])) for record in self.metrics if name in record]

    def has(self, name: str) -> bool:
        return any(name in record for record in self.metrics)

    def setting(self, section: str, key: str) -> Any:
        value = self.config.get(section)
        return value.get(key) if isinstance(value, dict) else None


@dataclass(frozen=True)
class Chart:
    """One card of the page: a title, an SVG (or a note why there is none) and a legend."""

    title: str
    svg: str = ""
    legend: tuple[tuple[str, str, float], ...] = ()  # (label, css color, opacity)
    note: str = ""
    caption: str = ""


def number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Reads the JSON objects of a JSONL file; a missing file, torn or invalid lines are skipped."""
    if not path.is_file():
        return []
    records = []
    with path.open(encoding="utf-8", errors="replace") as lines:
        for line in lines:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict):
                records.append(record)
    return records


def _read_mapping(path: Path, parse: Callable[[str], Any]) -> dict[str, Any]:
    try:
        value = parse(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, yaml.YAMLError):
        return {}
    return value if isinstance(value, dict) else {}


def load_run(run_dir: Path) -> RunData:
    """Reads a run directory's logs; keeps the last record of a step logged twice."""
    by_step: dict[int, dict[str, Any]] = {}
    for record in read_jsonl(run_dir / METRICS_FILE):
        if isinstance(record.get("step"), int) and not isinstance(record["step"], bool):
            by_step[record["step"]] = record
    return RunData(
        run_dir=run_dir,
        metrics=[by_step[step] for step in sorted(by_step)],
        samples=read_jsonl(run_dir / SAMPLES_FILE),
        events=read_jsonl(run_dir / EVENTS_FILE),
        config=_read_mapping(run_dir / "config.yaml", yaml.safe_load),
        summary=_read_mapping(run_dir / "summary.json", json.loads),
    )


def _lines(run: RunData, names: list[str], first_color: int = 0) -> list[Line]:
    present = [name for name in names if run.has(name)]
    return [
        Line(name, run.series(name), PALETTE[(first_color + i) % len(PALETTE)], dashed=i > 0)
        for i, name in enumerate(present)
    ]


def _band(run: RunData, low: str, high: str, label: str, color: str) -> list[Band]:
    lows, highs = dict(run.series(low)), dict(run.series(high))
    points = [
        (step, lows[step], highs[step])
        for step in sorted(lows.keys() & highs.keys())
        if lows[step] is not None and highs[step] is not None
    ]
    return [Band(label, points, color)] if points else []


def event_marks(run: RunData) -> list[tuple[float, str]]:
    """``(step, "kind at step N")`` of the notable events that name a step, one per step."""
    marks: dict[float, str] = {}
    for event in run.events:
        step = number(event.get("step"))
        if event.get("kind") in ATTENTION and step is not None:
            marks.setdefault(step, f"{event['kind']} at step {step:g}")
    return sorted(marks.items())[:MAX_MARKS]


def _chart(
    run: RunData,
    title: str,
    lines: list[Line],
    bands: list[Band],
    wanted: list[str],
    caption: str = "",
    **options: Any,
) -> Chart:
    if not any(line.points for line in lines) and not any(band.points for band in bands):
        return Chart(title, note=f"not logged in this run ({', '.join(wanted)})")
    legend = [(_with_last(line), line.color, 1.0) for line in lines]
    legend += [(band.label, band.color, band.opacity) for band in bands]
    marks = event_marks(run)
    if marks:
        legend.append(("notable event", EVENT_COLOR, 1.0))
    if any(value is None for line in lines for _, value in line.points):
        legend.append(("non-finite value logged", NONFINITE_COLOR, 1.0))
    svg = line_chart(lines, bands, title=title, vlines=marks, **options)
    longest = max(len(series.points) for series in [*lines, *bands])
    if longest > MAX_POINTS:
        per_point = math.ceil(longest / MAX_POINTS)
        shrunk = f"each point: mean of {per_point} steps, pale shade: their min–max"
        caption = f"{caption}; {shrunk}" if caption else shrunk
    return Chart(title, svg, tuple(legend), "", caption)


def _with_last(line: Line) -> str:
    finite = [value for _, value in line.points if value is not None]
    return f"{line.label} {format_number(finite[-1])}" if finite else line.label


def simple_chart(run: RunData, title: str, names: list[str], **options: Any) -> Chart:
    """A chart of the given metrics as lines (the first solid, the rest dashed)."""
    return _chart(run, title, _lines(run, names), [], names, **options)


def reward_chart(run: RunData) -> Chart:
    lines = _lines(run, ["critic/score/mean"])
    bands = _band(run, "critic/score/min", "critic/score/max", "min–max", PALETTE[0])
    return _chart(run, "Reward (trained samples)", lines, bands, ["critic/score/mean"])


def validation_chart(run: RunData) -> Chart:
    names = sorted({key for record in run.metrics for key in record if key.startswith("val/")})
    names = [n for n in names if n == "val/accuracy" or re.match(r"val/(pass|mean)@", n)]
    names.sort(key=lambda n: (n != "val/accuracy", n))
    wanted = ["val/accuracy", "val/pass@k"]
    return _chart(run, "Validation accuracy", _lines(run, names), [], wanted, y_floor=0.0)


def length_chart(run: RunData) -> Chart:
    """Mean/max response length, min–max and percentile bands when logged, the token limit."""
    percentiles = sorted(
        {
            key
            for record in run.metrics
            for key in record
            if re.fullmatch(r"response_length/p\d+", key)
        },
        key=lambda key: int(key.rsplit("p", 1)[1]),
    )
    lines = _lines(run, ["response_length/mean", "response_length/max"])
    bands = _band(run, "response_length/min", "response_length/max", "min–max", PALETTE[0])
    for i in range(len(percentiles) // 2):
        low, high = percentiles[i], percentiles[-1 - i]
        bands += _band(run, low, high, f"{low.split('/')[1]}–{high.split('/')[1]}", PALETTE[0])
    limit = run.setting("rollout", "max_new_tokens")
    hlines = [(float(limit), f"limit {limit}")] if isinstance(limit, int) else []
    wanted = ["response_length/mean", "response_length/max"]
    return _chart(run, "Response length (tokens)", lines, bands, wanted, y_floor=0.0, hlines=hlines)


def length_distribution_chart(run: RunData) -> Chart:
    """Heat strip of logged samples' lengths: tokens when samples carry ``response_length``."""
    title = "Response length distribution (logged samples)"
    tokens = any("response_length" in sample for sample in run.samples)
    values = []
    for sample in run.samples:
        length = sample.get("response_length") if tokens else len(str(sample.get("response", "")))
        if isinstance(sample.get("step"), int) and number(length) is not None:
            values.append((sample["step"], float(length)))
    if not values:
        return Chart(title, note="not logged in this run (samples.jsonl)")
    steps = sorted({step for step, _ in values})
    per_column = max(1, math.ceil(len(steps) / HEAT_COLUMNS))
    groups = [steps[i : i + per_column] for i in range(0, len(steps), per_column)]
    high = max(length for _, length in values)
    width = max(1.0, math.ceil((high + 1) / HEAT_BINS))
    # Bin i holds whole lengths i*width .. (i+1)*width - 1; edges sit half a unit below.
    edges = [i * width - 0.5 for i in range(math.ceil((high + 1) / width) + 1)]
    columns = []
    for group in groups:
        members = set(group)
        lengths = [length for step, length in values if step in members]
        counts = [0] * (len(edges) - 1)
        for length in lengths:
            counts[min(int(length // width), len(counts) - 1)] += 1
        columns.append((group[0], group[-1], [count / len(lengths) for count in counts]))
    unit = "tokens" if tokens else "characters"
    caption = f"y: {unit} per response; darker = larger share of that step range's samples"
    svg = heat_strip(columns, edges, title=title)
    return Chart(title, svg, (("share of samples", PALETTE[0], 1.0),), "", caption)


def stage_times(run: RunData) -> dict[str, dict[float, float | None]]:
    """Each logged stage's seconds by step, as the timing chart stacks them (``prepare`` less
    the passes it contains, so that no second is drawn twice)."""
    stacked = {}
    for part in TIMING_PARTS:
        if run.has(f"timing_s/{part}"):
            stacked[part] = dict(run.series(f"timing_s/{part}"))
    if "prepare" in stacked:
        inner = [stacked[part] for part in ("ref", "old") if part in stacked]
        stacked["prepare"] = {
            step: None
            if value is None
            else max(0.0, value - sum(p.get(step) or 0.0 for p in inner))
            for step, value in stacked["prepare"].items()
        }
    return stacked


def stacked_bands(series: dict[str, dict[float, float | None]], first_color: int = 1) -> list[Band]:
    """Each series as a band stacked on the ones before it (a missing or non-finite value
    adds nothing at its step)."""
    steps = sorted({step for values in series.values() for step in values})
    base, bands = dict.fromkeys(steps, 0.0), []
    for i, (label, values) in enumerate(series.items()):
        points = []
        for step in steps:
            low = base[step]
            base[step] = low + (values.get(step) or 0.0)
            points.append((step, low, base[step]))
        color = PALETTE[(first_color + i) % len(PALETTE)]
        bands.append(Band(label, points, color, opacity=0.55))
    return bands


def timing_chart(run: RunData) -> Chart:
    """Stacked stage times with the whole step's time as a line (the gap is everything else)."""
    bands = stacked_bands(stage_times(run))
    lines = _lines(run, ["timing_s/step"])
    wanted = [f"timing_s/{part}" for part in TIMING_PARTS[:3]] + ["timing_s/step"]
    caption = "stacked: seconds per stage; line: the whole step"
    return _chart(run, "Time per step", lines, bands, wanted, caption, y_floor=0.0)


def token_age_chart(run: RunData) -> Chart:
    """Partial rollouts: the batch's tokens stacked by how many policy versions older than
    the weights they train they are, and the cache tokens a kept KV cache saved."""
    ages = sorted(
        {
            int(key[len(TOKEN_AGE) :])
            for record in run.metrics
            for key in record
            if re.fullmatch(rf"{TOKEN_AGE}\d+", key)
        }
    )
    bands = stacked_bands(
        {
            f"{age} version{'' if age == 1 else 's'} behind": dict(run.series(f"{TOKEN_AGE}{age}"))
            for age in ages
        },
        first_color=0,
    )
    lines = _lines(run, ["partial/kv_kept_tokens"], first_color=len(ages))
    caption = "stacked: the batch's tokens by versions behind the weights they train"
    if lines:
        caption += "; line: tokens reused from a kept KV cache"
    wanted = [f"{TOKEN_AGE}<a>", "partial/kv_kept_tokens"]
    return _chart(run, "Partial rollouts: token age", lines, bands, wanted, caption, y_floor=0.0)


def charts(run: RunData) -> list[Chart]:
    """Every chart of the report, in page order: the common ones, then those of
    ``OPTIONAL_CHARTS`` whose metrics the run logged and, for partial rollouts, the token
    ages; a feature the run did not use gets no empty card."""
    logged = {key for record in run.metrics for key in record}
    optional = [
        simple_chart(run, title, list(names), y_floor=0.0)
        for title, names in OPTIONAL_CHARTS
        if logged.intersection(names)
    ]
    if any(key.startswith(TOKEN_AGE) or key == "partial/kv_kept_tokens" for key in logged):
        optional.append(token_age_chart(run))
    return _common_charts(run) + optional


def _common_charts(run: RunData) -> list[Chart]:
    return [
        reward_chart(run),
        validation_chart(run),
        length_chart(run),
        length_distribution_chart(run),
        simple_chart(run, "Entropy", ["actor/entropy"]),
        simple_chart(run, "KL", ["actor/ppo_kl", "actor/kl_loss"]),
        simple_chart(
            run,
            "Clip fractions",
            ["actor/pg_clipfrac", "actor/pg_clipfrac_lower", "response_length/clip_ratio"],
            y_floor=0.0,
        ),
        simple_chart(run, "Gradient norm", ["actor/grad_norm"], y_floor=0.0),
        timing_chart(run),
        simple_chart(
            run,
            "Throughput (tokens/s)",
            ["perf/throughput", "perf/gen_tokens_per_s", "perf/train_tokens_per_s"],
            y_floor=0.0,
        ),
        simple_chart(
            run,
            "Verifier latency (ms)",
            ["reward/latency_p99_ms", "reward/latency_p50_ms"],
            y_floor=0.0,
        ),
        simple_chart(
            run,
            "Samples per step",
            [
                "samples/generated",
                "samples/trained",
                "samples/filtered",
                "samples/failed",
                "samples/stale",
            ],
            y_floor=0.0,
        ),
    ]
