"""Tiny SVG charts for the run report: lines, shaded bands and a heat strip, no dependencies.

The report must open offline from a file (no JavaScript, no CDN), so the charts are inline
SVG strings written here. Each chart is one ``<svg>`` element with light grid lines, "nice"
tick labels on both axes and the data as ``<path>`` elements (class ``data``); legends are
left to the surrounding HTML so labels never cover the data.

Limits: one linear y axis per chart; long series are averaged into at most ``MAX_POINTS``
points (with their min–max envelope shaded) to keep the file small; values that were logged
but are not finite (``None``, i.e. NaN/inf in ``metrics.jsonl``) are drawn as red ticks on the
x axis rather than as points.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import dataclass

WIDTH, HEIGHT = 560, 210
LEFT, RIGHT, TOP, BOTTOM = 56, 14, 10, 26
MAX_POINTS = 300
DOT_LIMIT = 40  # series with at most this many points also get a dot per point
NONFINITE_COLOR = "#d62728"
EVENT_COLOR = "#9b59b6"
PALETTE = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#17becf",
    "#bcbd22",
    "#7f7f7f",
)

Point = tuple[float, float | None]  # (step, value); None = logged but not finite


@dataclass(frozen=True)
class Line:
    """One series drawn as a polyline; gaps where a value is ``None``."""

    label: str
    points: Sequence[Point]
    color: str
    dashed: bool = False


@dataclass(frozen=True)
class Band:
    """A shaded area between ``low`` and ``high`` at each step: ``(step, low, high)``."""

    label: str
    points: Sequence[tuple[float, float, float]]
    color: str
    opacity: float = 0.18


def format_number(value: float) -> str:
    """Formats a tick or a value compactly: ``0.25``, ``1.2k``, ``3.4M``, ``1e-05``."""
    if value == 0 or not math.isfinite(value):
        return "0" if value == 0 else str(value)
    size = abs(value)
    if size >= 1e6:
        return f"{value / 1e6:.3g}M"
    if size >= 1e4:
        return f"{value / 1e3:.3g}k"
    if size < 1e-3:
        return f"{value:.0e}"
    return f"{value:.4g}"


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """Round tick values covering ``[low, high]``: steps of 1, 2 or 5 times a power of ten.

    Args:
        low: Smallest value to cover.
        high: Largest value to cover; must be greater than ``low``.
        count: Roughly how many ticks to produce.

    Returns:
        Ascending tick values inside ``[low, high]`` (at least one).
    """
    raw = (high - low) / max(count, 1)
    power = 10 ** math.floor(math.log10(raw))
    # The candidate step nearest to the raw one on a log scale keeps the count near ``count``.
    step = min((m * power for m in (1, 2, 5, 10)), key=lambda s: abs(math.log(s / raw)))
    first = math.ceil(low / step - 1e-9)
    last = math.floor(high / step + 1e-9)
    ticks = [round(i * step, 12) for i in range(first, last + 1)]
    return ticks or [low]


def downsample(points: Sequence[Point], max_points: int = MAX_POINTS) -> list[tuple]:
    """Averages consecutive points into at most ``max_points`` buckets.

    Args:
        points: ``(step, value)`` sorted by step; ``None`` values are skipped in the average.
        max_points: Upper bound on the number of buckets.

    Returns:
        ``(step, mean, low, high)`` per bucket (mean step; mean, min and max of the finite
        values), or ``(step, None, None, None)`` for a bucket with none. Short series come
        back one point per bucket.
    """
    size = max(1, math.ceil(len(points) / max_points))
    buckets = []
    for start in range(0, len(points), size):
        chunk = points[start : start + size]
        step = sum(x for x, _ in chunk) / len(chunk)
        values = [y for _, y in chunk if y is not None]
        if values:
            buckets.append((step, sum(values) / len(values), min(values), max(values)))
        else:
            buckets.append((step, None, None, None))
    return buckets


class _Frame:
    """Maps data coordinates to pixels inside the plot area."""

    def __init__(self, x_range: tuple[float, float], y_range: tuple[float, float]) -> None:
        self.x0, self.x1 = x_range
        self.y0, self.y1 = y_range

    def x(self, value: float) -> float:
        return LEFT + (value - self.x0) / (self.x1 - self.x0) * (WIDTH - LEFT - RIGHT)

    def y(self, value: float) -> float:
        return HEIGHT - BOTTOM - (value - self.y0) / (self.y1 - self.y0) * (HEIGHT - TOP - BOTTOM)


def _padded(low: float, high: float) -> tuple[float, float]:
    if high > low:
        margin = (high - low) * 0.05
        return low - margin, high + margin
    spread = abs(low) * 0.1 or 1.0
    return low - spread, high + spread


def _axes(frame: _Frame, integer_x: bool) -> list[str]:
    parts = ['<g class="axes" font-size="11" fill="#555">']
    for tick in nice_ticks(frame.y0, frame.y1, 4):
        y = frame.y(tick)
        parts.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y:.1f}" y2="{y:.1f}" />')
        parts.append(
            f'<text x="{LEFT - 5}" y="{y + 4:.1f}" text-anchor="end">{format_number(tick)}</text>'
        )
    x_ticks = [t for t in nice_ticks(frame.x0, frame.x1, 6) if not integer_x or t == int(t)]
    for tick in x_ticks:
        x = frame.x(tick)
        label = format_number(int(tick) if integer_x else tick)
        parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{TOP}" y2="{HEIGHT - BOTTOM}" />')
        parts.append(
            f'<text x="{x:.1f}" y="{HEIGHT - BOTTOM + 15}" text-anchor="middle">{label}</text>'
        )
    parts.append("</g>")
    return parts


def _compact(pixels: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Drops the inner points of horizontal runs (flat series cost two points, not hundreds)."""
    kept = []
    for i, point in enumerate(pixels):
        flat = 0 < i < len(pixels) - 1 and pixels[i - 1][1] == point[1] == pixels[i + 1][1]
        if not flat:
            kept.append(point)
    return kept


def _polyline(frame: _Frame, points: Sequence[tuple[float, float | None]]) -> str:
    segments: list[list[tuple[float, float]]] = [[]]
    for x, y in points:
        if y is None:
            segments.append([])
        else:
            segments[-1].append((round(frame.x(x), 1), round(frame.y(y), 1)))
    return "".join(
        "M" + "L".join(f"{x:g} {y:g}" for x, y in _compact(segment))
        for segment in segments
        if segment
    )


def _area(frame: _Frame, points: Sequence[tuple[float, float, float]]) -> str:
    if not points:
        return ""
    upper = [(round(frame.x(x), 1), round(frame.y(high), 1)) for x, _, high in points]
    lower = [(round(frame.x(x), 1), round(frame.y(low), 1)) for x, low, _ in reversed(points)]
    corners = _compact(upper) + _compact(lower)
    return "M" + "L".join(f"{x:g} {y:g}" for x, y in corners) + "Z"


def _extent(lines: Sequence[Line], bands: Sequence[Band]) -> tuple[list[float], list[float]]:
    xs = [x for line in lines for x, _ in line.points]
    xs += [x for band in bands for x, _, _ in band.points]
    ys = [y for line in lines for _, y in line.points if y is not None]
    ys += [v for band in bands for _, low, high in band.points for v in (low, high)]
    return xs, ys


def line_chart(
    lines: Sequence[Line],
    bands: Sequence[Band] = (),
    *,
    y_floor: float | None = None,
    hlines: Sequence[tuple[float, str]] = (),
    vlines: Sequence[tuple[float, str]] = (),
    title: str = "",
) -> str:
    """Draws lines over shaded bands on step axes, as one ``<svg>`` element.

    Args:
        lines: Series to draw as lines (long ones are downsampled, with a faint min–max
            envelope when they are).
        bands: Shaded areas drawn under the lines (downsampled the same way).
        y_floor: A value the y axis must include (e.g. 0 for accuracies and lengths).
        hlines: Horizontal reference lines ``(y, label)``, e.g. a length limit.
        vlines: Vertical marks ``(step, label)``, e.g. alerts and rollbacks; marks outside
            the steps of the data are left out. The label is a tooltip.
        title: Accessible title of the SVG (shown as a tooltip).

    Returns:
        The SVG markup. Lines and bands with no finite value draw nothing; the caller decides
        whether to show a chart at all.
    """
    xs, ys = _extent(lines, bands)
    ys += [y for y, _ in hlines] + ([y_floor] if y_floor is not None else [])
    x_range = (min(xs), max(xs)) if xs else (0.0, 1.0)
    x_range = x_range if x_range[1] > x_range[0] else (x_range[0] - 1, x_range[0] + 1)
    frame = _Frame(x_range, _padded(min(ys), max(ys)) if ys else (0.0, 1.0))
    integer_x = all(float(x).is_integer() for x in xs)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" '
        f'role="img"><title>{html.escape(title)}</title>',
        *_axes(frame, integer_x),
    ]
    for band in bands:
        merged = _merge_band(band.points)
        parts.append(
            f'<path class="data band" d="{_area(frame, merged)}" fill="{band.color}" '
            f'fill-opacity="{band.opacity}" stroke="none" />'
        )
    parts += _reference_lines(frame, hlines, vlines)
    for line in lines:
        parts += _line_parts(frame, line)
    parts += _nonfinite_marks(frame, lines)
    parts.append("</svg>")
    return "".join(parts)


def _reference_lines(
    frame: _Frame, hlines: Sequence[tuple[float, str]], vlines: Sequence[tuple[float, str]]
) -> list[str]:
    """Labelled horizontal limits and vertical event marks (a tooltip each)."""
    parts = []
    for y, label in hlines:
        parts.append(
            f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{frame.y(y):.1f}" y2="{frame.y(y):.1f}" '
            f'stroke="#d62728" stroke-dasharray="6 3"><title>{html.escape(label)}</title></line>'
            f'<text x="{WIDTH - RIGHT - 4}" y="{frame.y(y) - 4:.1f}" font-size="11" '
            f'fill="#d62728" text-anchor="end">{html.escape(label)}</text>'
        )
    for x, label in vlines:
        if frame.x0 <= x <= frame.x1:
            parts.append(
                f'<line class="event" x1="{frame.x(x):.1f}" x2="{frame.x(x):.1f}" y1="{TOP}" '
                f'y2="{HEIGHT - BOTTOM}" stroke="{EVENT_COLOR}" stroke-dasharray="2 2">'
                f"<title>{html.escape(label)}</title></line>"
            )
    return parts


def _merge_band(points: Sequence[tuple[float, float, float]]) -> list[tuple]:
    """Chunks a band like ``downsample``: mean step, lowest low, highest high."""
    size = max(1, math.ceil(len(points) / MAX_POINTS))
    chunks = [points[start : start + size] for start in range(0, len(points), size)]
    return [
        (sum(p[0] for p in chunk) / len(chunk), min(p[1] for p in chunk), max(p[2] for p in chunk))
        for chunk in chunks
    ]


def _line_parts(frame: _Frame, line: Line) -> list[str]:
    buckets = downsample(line.points)
    parts = []
    envelope = [(x, low, high) for x, mean, low, high in buckets if mean is not None]
    if len(buckets) < len(line.points) and any(low < high for _, low, high in envelope):
        parts.append(
            f'<path class="envelope" d="{_area(frame, envelope)}" fill="{line.color}" '
            'fill-opacity="0.12" stroke="none" />'
        )
    dash = ' stroke-dasharray="5 3"' if line.dashed else ""
    path = _polyline(frame, [(x, mean) for x, mean, _, _ in buckets])
    if path:
        parts.append(
            f'<path class="data line" d="{path}" fill="none" stroke="{line.color}" '
            f'stroke-width="1.6"{dash} />'
        )
    if len(buckets) <= DOT_LIMIT:
        parts += [
            f'<circle cx="{frame.x(x):.1f}" cy="{frame.y(mean):.1f}" r="2.6" fill="{line.color}" />'
            for x, mean, _, _ in buckets
            if mean is not None
        ]
    return parts


def _nonfinite_marks(frame: _Frame, lines: Sequence[Line]) -> list[str]:
    pixels = sorted({round(frame.x(x)) for line in lines for x, y in line.points if y is None})
    if not pixels:
        return []
    bottom = HEIGHT - BOTTOM
    ticks = "".join(f"M{x} {bottom}v-8" for x in pixels)
    return [
        f'<path class="nonfinite" d="{ticks}" stroke="{NONFINITE_COLOR}" stroke-width="2">'
        "<title>non-finite value logged (NaN or inf)</title></path>"
    ]


def heat_strip(
    columns: Sequence[tuple[float, float, Sequence[float]]],
    edges: Sequence[float],
    color: str = "#1f77b4",
    title: str = "",
) -> str:
    """Draws a distribution over time: one column per step range, shaded by share per bin.

    Args:
        columns: ``(first_step, last_step, fractions)`` per column; ``fractions[i]`` is the
            share of that column's values in bin ``i`` (0..1), shading each cell.
        edges: ``len(fractions) + 1`` ascending bin edges for the y axis.
        color: Fill of the cells.
        title: Accessible title of the SVG.

    Returns:
        The SVG markup (axes and one ``rect`` per non-empty cell).
    """
    x0 = min(first for first, _, _ in columns) - 0.5
    x1 = max(last for _, last, _ in columns) + 0.5
    frame = _Frame((x0, x1), (edges[0], edges[-1]))
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" '
        f'role="img"><title>{html.escape(title)}</title>',
        *_axes(frame, True),
        f'<g class="data heat" fill="{color}">',
    ]
    for first, last, fractions in columns:
        left, right = frame.x(first - 0.5), frame.x(last + 0.5)
        for low, high, share in zip(edges, edges[1:], fractions, strict=False):
            if share <= 0:
                continue
            top, bottom = frame.y(high), frame.y(low)
            parts.append(
                f'<rect x="{left:.1f}" y="{top:.1f}" width="{right - left:.1f}" '
                f'height="{bottom - top:.1f}" fill-opacity="{0.1 + 0.9 * share:.2f}" />'
            )
    parts.append("</g></svg>")
    return "".join(parts)
