"""``honing report RUN_DIR``: one self-contained HTML page showing the state of a run.

The page (``RUN_DIR/report.html``) has a header (steps done, wall time, validation accuracy
first → last, stops / rollbacks / restarts / non-finite values), one SVG chart per signal
(reward, validation, response length and its distribution, entropy, KL, clip fractions, grad
norm, timing, throughput, verifier latency, sample accounting), the newest logged samples
and the event log. It uses no JavaScript and no network: CSS and charts are inline, so it
opens from a ``file://`` URL offline and can be mailed or archived as one file.

A chart whose metrics are absent shows "not logged in this run" instead. Torn or invalid
JSONL lines (a crash mid-write) are skipped. The report reads the files once and holds them in
memory; for a run of thousands of steps this is a few MB, and charts downsample to at most
``plots.MAX_POINTS`` points per series, so the HTML stays around 100-200 KB.
"""

from __future__ import annotations

import html
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from honing.errors import UserError
from honing.monitor.logger import METRICS_FILE
from honing.monitor.report_charts import ATTENTION, Chart, RunData, charts, load_run, number
from honing.monitor.sinks import cannot_write

REPORT_FILE = "report.html"
MAX_EVENT_ROWS = 300
MAX_SAMPLE_ROWS = 8


STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:0;background:#f4f5f7;color:#222}
header{background:#fff;padding:14px 24px;border-bottom:1px solid #ddd}
h1{font-size:20px;margin:0 0 6px}h2{font-size:16px;margin:24px 24px 8px}
.facts{display:flex;flex-wrap:wrap;gap:6px 28px}.facts b{font-weight:600}
.status{margin-top:8px;display:flex;flex-wrap:wrap;gap:6px}
.badge{padding:2px 8px;border-radius:10px;background:#e8f0fe;font-size:13px}
.badge.bad{background:#fde2e1;color:#a11}.badge.ok{background:#e3f5e1;color:#175e12}
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(540px,1fr));gap:14px;
margin:0 24px}
.card{background:#fff;border:1px solid #ddd;border-radius:6px;padding:10px 12px}
.card h3{font-size:14px;margin:0 0 4px}.card svg{width:100%;height:auto;display:block}
.axes line{stroke:#e6e6e6}.legend{font-size:12px;color:#444}
.legend span{margin-right:12px;white-space:nowrap}
.legend i{display:inline-block;width:14px;height:4px;margin-right:4px;vertical-align:middle}
.note{color:#888;font-style:italic;padding:30px 0;text-align:center}
.caption{font-size:12px;color:#666}
table{border-collapse:collapse;margin:0 24px 24px;background:#fff;font-size:13px}
td,th{border:1px solid #ddd;padding:3px 8px;text-align:left;vertical-align:top}
td{max-width:560px;white-space:pre-wrap;word-break:break-word}
th{background:#f0f0f0}tr.bad td{background:#fdecea}td.mono{font-family:monospace}
"""
STOP_KINDS = {"stop", "stopped"}
RESTART_KINDS = {"restart", "restarted", "resumed"}


def _esc(value: Any) -> str:
    return html.escape(str(value))


def _utc(seconds: Any) -> str:
    if number(seconds) is None:
        return "?"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(seconds))


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


def _actions(event: dict[str, Any]) -> list[Any]:
    """An alert's actions: ``"actions": [...]`` (honing's alerts) or one ``"action"``."""
    actions = event.get("actions", [event["action"]] if "action" in event else [])
    return actions if isinstance(actions, list) else [actions]


def _is_attention(event: dict[str, Any]) -> bool:
    return event.get("kind") in ATTENTION


def _first_last(run: RunData, name: str) -> str:
    finite = [(step, value) for step, value in run.series(name) if value is not None]
    if not finite:
        return "not logged"
    (first_step, first), (last_step, last) = finite[0], finite[-1]
    return f"{first:.4g} (step {first_step}) → {last:.4g} (step {last_step})"


def _progress_badge(run: RunData, last_step: int | None, total: Any) -> str:
    stops = [event for event in run.events if event.get("kind") in STOP_KINDS]
    if stops:
        step = stops[-1].get("step", last_step)
        return f'<span class="badge bad">stopped at step {_esc(step)}</span>'
    if last_step is None:
        return '<span class="badge">no step logged yet</span>'
    if isinstance(total, int) and last_step >= total:
        return '<span class="badge ok">finished</span>'
    return f'<span class="badge">running or interrupted at step {last_step}</span>'


def _status_badges(run: RunData, last_step: int | None, total: Any) -> list[str]:
    """Progress, then one badge per kind of notable event (alerts list their actions)."""
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for event in run.events:
        kind = event.get("kind")
        if kind in ATTENTION - STOP_KINDS or kind in RESTART_KINDS:
            by_kind.setdefault(str(kind), []).append(event)
    badges = [_progress_badge(run, last_step, total)]
    for kind, events in sorted(by_kind.items()):
        actions = sorted({str(action) for e in events for action in _actions(e)})
        label = f"{kind} ×{len(events)}" + (f" ({', '.join(actions)})" if actions else "")
        step = events[-1].get("step")
        label += f", last at step {step}" if step is not None else ""
        css = "badge" if kind in RESTART_KINDS else "badge bad"
        badges.append(f'<span class="{css}">{_esc(label)}</span>')
    nonfinite = sum(
        1 for record in run.metrics for key, v in record.items() if key != "time" and v is None
    )
    if nonfinite:
        badges.append(f'<span class="badge bad">{nonfinite} non-finite metric values</span>')
    return badges


def render_header(run: RunData) -> str:
    """Run directory, progress, wall time, validation first → last, status badges."""
    last_step = run.metrics[-1]["step"] if run.metrics else None
    total = run.setting("trainer", "total_steps")
    times = [t for record in run.metrics if (t := number(record.get("time"))) is not None]
    seconds = number(run.summary.get("seconds"))
    if seconds is None and len(times) > 1:
        seconds = times[-1] - times[0]
    pass_keys = sorted({k for r in run.metrics for k in r if k.startswith("val/pass@")})
    facts = [
        ("steps", f"{last_step if last_step is not None else 0} of {total or '?'}"),
        ("wall time", _duration(seconds) if seconds is not None else "?"),
        ("val/accuracy", _first_last(run, "val/accuracy")),
        *[(key, _first_last(run, key)) for key in pass_keys[:1]],
        ("last logged", f"{_utc(times[-1])} UTC" if times else "nothing yet"),
    ]
    items = "".join(f"<span><b>{_esc(k)}:</b> {_esc(v)}</span>" for k, v in facts)
    badges = "".join(_status_badges(run, last_step, total))
    return (
        f"<header><h1>honing run: {_esc(run.run_dir)}</h1><div class=facts>{items}</div>"
        f"<div class=status>{badges}</div></header>"
    )


def render_chart(chart: Chart) -> str:
    legend = "".join(
        f'<span><i style="background:{color};opacity:{opacity}"></i>{_esc(label)}</span>'
        for label, color, opacity in chart.legend
    )
    body = chart.svg or f'<div class="note">{_esc(chart.note)}</div>'
    caption = f'<div class="caption">{_esc(chart.caption)}</div>' if chart.caption else ""
    return (
        f'<section class="card"><h3>{_esc(chart.title)}</h3>'
        f'<div class="legend">{legend}</div>{body}{caption}</section>'
    )


def render_events(events: list[dict[str, Any]]) -> str:
    """The event log as a table, newest ``MAX_EVENT_ROWS`` rows; alerts/stops highlighted."""
    if not events:
        return "<h2>Events</h2><p style='margin:0 24px 24px'>No events logged.</p>"
    shown = events[-MAX_EVENT_ROWS:]
    rows = []
    for event in shown:
        fields = " ".join(
            f"{k}={json.dumps(v, ensure_ascii=False)}"
            for k, v in event.items()
            if k not in ("time", "kind")
        )
        css = ' class="bad"' if _is_attention(event) else ""
        rows.append(
            f"<tr{css}><td>{_esc(_utc(event.get('time')))}</td><td>{_esc(event.get('kind'))}"
            f"</td><td class=mono>{_esc(fields)}</td></tr>"
        )
    more = len(events) - len(shown)
    title = f"Events ({len(events)}" + (f", oldest {more} not shown)" if more else ")")
    return (
        f"<h2>{_esc(title)}</h2><table class=events><tr><th>time (UTC)</th><th>kind</th>"
        f"<th>fields</th></tr>{''.join(rows)}</table>"
    )


def render_samples(samples: list[dict[str, Any]]) -> str:
    """The newest logged generations: prompt, response, reward, verdict."""
    if not samples:
        return ""
    rows = []
    for sample in samples[-MAX_SAMPLE_ROWS:]:
        cells = [sample.get(k, "") for k in ("step", "prompt", "response", "reward")]
        cells.append(sample.get("verdict", sample.get("finish_reason", "")))
        rows.append(
            "<tr>" + "".join(f"<td class=mono>{_esc(str(c)[:300])}</td>" for c in cells) + "</tr>"
        )
    return (
        "<h2>Newest samples</h2><table><tr><th>step</th><th>prompt</th><th>response</th>"
        f"<th>reward</th><th>verdict</th></tr>{''.join(rows)}</table>"
    )


def render_report(run: RunData) -> str:
    """The whole page as one HTML string."""
    cards = "".join(render_chart(chart) for chart in charts(run))
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f"<title>honing report: {_esc(run.run_dir.name)}</title><style>{STYLE}</style></head>"
        f"<body>{render_header(run)}<h2>Signals over steps</h2><div class=grid>{cards}</div>"
        f"{render_samples(run.samples)}{render_events(run.events)}"
        f"<p class=caption style='margin:0 24px 24px'>written {_esc(_utc(time.time()))} UTC "
        "by honing report</p></body></html>\n"
    )


def write_report(run_dir: Path, out: Path | None = None) -> Path:
    """Writes the run's HTML report (default ``RUN_DIR/report.html``) and returns its path.

    The file is written to a temporary name and renamed, so a browser refreshing it during a
    run never sees half a page.

    Raises:
        UserError: ``run_dir`` is not a directory or has no ``metrics.jsonl``, or the report
            cannot be written (a full disk: ``cannot_write``).
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"{run_dir}: no such run directory")
    if not (run_dir / METRICS_FILE).is_file():
        raise UserError(
            f"{run_dir}: no {METRICS_FILE} here; give the --output-dir of a 'honing train' run"
        )
    out = Path(out) if out is not None else run_dir / REPORT_FILE
    page = render_report(load_run(run_dir))
    tmp_name = None
    try:
        descriptor, tmp_name = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
        with os.fdopen(descriptor, "w", encoding="utf-8") as target:
            target.write(page)
        os.replace(tmp_name, out)
    except BaseException as err:
        if tmp_name is not None:
            Path(tmp_name).unlink(missing_ok=True)
        if isinstance(err, OSError):  # a full disk, a read-only directory
            raise cannot_write(out, err, then=f"run honing report {run_dir} again") from None
        raise
    return out


def report_main(run_dir: str) -> int:
    """Entry point of ``honing report RUN_DIR``: writes the report, prints its path, returns 0."""
    print(write_report(Path(run_dir)))
    return 0
