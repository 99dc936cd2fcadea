"""The panel's chart grid: one small inline-SVG chart per metric.

Each metric gets its own axes (its own value range and its own step range), so a loss of
about 1 logged every step and a total of about 1000 logged once per epoch are both readable.
Values several ranks log under the same key at the same step are one point: their mean,
drawn as a line, with their min-max as a band behind it. A metric with few points (once per
epoch) gets a marker on each. At most `MAX_CHARTS` charts; the other metrics are
listed by name and last value. Plain SVG with inline styles (saved notebooks keep it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from html import escape
from itertools import groupby
from operator import itemgetter

Series = Mapping[str, Sequence[tuple[float, float]]]  # metric -> [(step, value), ...] raw
Agg = list[tuple[float, float, float, float]]  # (step, mean, min, max), by step

MAX_CHARTS = 12
MAX_POINTS = 300  # per chart: more distinct steps are merged into this many buckets
MARKERS_UP_TO = 24  # points: each one gets a marker
W, H = 210, 118
_LINE, _BAND = "#1f77b4", "#1f77b4"


def fmt(v: float) -> str:
    if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
        return f"{v:.3g}"
    return f"{v:.4g}"


def aggregate(points: Sequence[tuple[float, float]]) -> Agg:
    """Raw ``(step, value)`` points (several ranks may log one step) -> one
    ``(step, mean, min, max)`` per step, in step order, at most `MAX_POINTS`."""
    agg: Agg = []
    for step, same in groupby(sorted(points), key=itemgetter(0)):
        vals = [v for _, v in same if v == v]  # NaN: nothing to draw
        if vals:
            agg.append((float(step), sum(vals) / len(vals), min(vals), max(vals)))
    if len(agg) <= MAX_POINTS:
        return agg
    s0, s1 = agg[0][0], agg[-1][0]
    width = (s1 - s0) / MAX_POINTS or 1.0
    buckets: dict[int, list[tuple[float, float, float, float]]] = {}
    for p in agg:
        buckets.setdefault(min(MAX_POINTS - 1, int((p[0] - s0) / width)), []).append(p)
    out: Agg = []
    for group in (buckets[k] for k in sorted(buckets)):
        out.append(
            (
                group[-1][0],
                sum(p[1] for p in group) / len(group),
                min(p[2] for p in group),
                max(p[3] for p in group),
            )
        )
    return out


def chart(name: str, agg: Agg) -> str:
    """One metric's chart (own axes): title with the latest value and its step."""
    if not agg:
        return ""
    x0, x1 = agg[0][0], agg[-1][0]
    y0, y1 = min(p[2] for p in agg), max(p[3] for p in agg)
    if x1 == x0:
        x0, x1 = x0 - 0.5, x1 + 0.5
    if y1 == y0:
        pad = abs(y0) * 0.05 or 0.5
        y0, y1 = y0 - pad, y1 + pad
    left, right, top, bottom = 44, 6, 4, 16
    pw, ph = W - left - right, H - top - bottom

    def sx(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * pw

    def sy(y: float) -> float:
        return top + (1 - (y - y0) / (y1 - y0)) * ph

    band = any(p[2] != p[3] for p in agg)
    parts = [
        f'<svg class="gangrun-chart" xmlns="http://www.w3.org/2000/svg" width="{W}" '
        f'height="{H}" viewBox="0 0 {W} {H}" style="font:9px sans-serif;display:block">',
        f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#ddd"/>',
        f'<text x="{left - 3}" y="{top + 8}" text-anchor="end">{fmt(y1)}</text>',
        f'<text x="{left - 3}" y="{top + ph}" text-anchor="end">{fmt(y0)}</text>',
        f'<text x="{left}" y="{H - 4}">{fmt(agg[0][0])}</text>',
        f'<text x="{left + pw}" y="{H - 4}" text-anchor="end">step {fmt(agg[-1][0])}</text>',
    ]
    if band and len(agg) > 1:
        upper = " ".join(f"{sx(s):.1f},{sy(hi):.1f}" for s, _, _, hi in agg)
        lower = " ".join(f"{sx(s):.1f},{sy(lo):.1f}" for s, _, lo, _ in reversed(agg))
        parts.append(
            f'<polygon class="gangrun-band" points="{upper} {lower}" fill="{_BAND}" '
            'fill-opacity="0.18" stroke="none"><title>min-max over ranks</title></polygon>'
        )
    if len(agg) > 1:
        coords = " ".join(f"{sx(s):.1f},{sy(m):.1f}" for s, m, _, _ in agg)
        parts.append(
            f'<polyline class="gangrun-series" fill="none" stroke="{_LINE}" '
            f'stroke-width="1.5" points="{coords}"/>'
        )
    if len(agg) <= MARKERS_UP_TO:
        for s, m, lo, hi in agg:
            extra = f" (min {fmt(lo)}, max {fmt(hi)})" if lo != hi else ""
            parts.append(
                f'<circle cx="{sx(s):.1f}" cy="{sy(m):.1f}" r="2.2" fill="{_LINE}">'
                f"<title>step {fmt(s)}: {fmt(m)}{extra}</title></circle>"
            )
    parts.append("</svg>")
    step, last = agg[-1][0], agg[-1][1]
    title = (
        f'<div style="display:flex;justify-content:space-between;gap:6px">'
        f'<b style="overflow:hidden;text-overflow:ellipsis;white-space:nowrap" '
        f'title="{escape(name)}">{escape(name)}</b>'
        f'<span class="gangrun-last">{fmt(last)} @ {fmt(step)}</span></div>'
    )
    attrs = (
        f'data-metric="{escape(name)}" data-points="{len(agg)}" data-band="{int(band)}" '
        f'data-y-min="{y0:.6g}" data-y-max="{y1:.6g}" '
        f'data-step-min="{agg[0][0]:g}" data-step-max="{agg[-1][0]:g}"'
    )
    return (
        f'<div class="gangrun-metric" {attrs} style="width:{W}px;border:1px solid #eee;'
        f'border-radius:3px;padding:2px 4px;font-size:11px">{title}{"".join(parts)}</div>'
    )


def grid(series: Series, more: Mapping[str, float] | None = None) -> str:
    """The chart grid: one chart per metric (the first `MAX_CHARTS` by name), then
    the other metrics' last values; ``""`` when there is nothing to show."""
    names = sorted(k for k, v in series.items() if v)
    shown = names[:MAX_CHARTS]
    charts = [chart(k, aggregate(series[k])) for k in shown]
    rest: dict[str, float] = {}
    for k in names[MAX_CHARTS:]:
        rest[k] = series[k][-1][1] if series[k] else float("nan")
    for k, v in (more or {}).items():
        if k not in series:
            rest[k] = v
    if not charts and not rest:
        return ""
    out = (
        '<div class="gangrun-charts" style="display:flex;flex-wrap:wrap;gap:6px;margin:4px 0">'
        + "".join(charts)
        + "</div>"
    )
    if rest:
        listed = " · ".join(f"{escape(k)} {fmt(v)}" for k, v in sorted(rest.items()))
        out += f'<div class="gangrun-more" style="font-size:11px">more: {listed}</div>'
    return out


__all__ = ["aggregate", "chart", "grid", "MAX_CHARTS", "Series"]
