"""HTML of the live panel, of ``RunHandle`` and of ``DistributedError`` (``_repr_html_``).

Plain HTML and inline SVG with inline styles only: it renders in JupyterLab, classic
Notebook, VS Code and nbconvert's HTML, and survives in a saved notebook. Every piece of
text that comes from a rank, a user or MLflow is escaped.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from html import escape
from typing import Any

from .state import CallSnapshot

_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2")
_STATE_COLOR = {
    "starting": "#888",
    "running": "#1f77b4",
    "finished": "#2ca02c",
    "failed": "#d62728",
    "stopped": "#b8860b",
    "FINISHED": "#2ca02c",
    "FAILED": "#d62728",
    "KILLED": "#b8860b",
}
_TD = 'style="padding:2px 8px;text-align:left;border-bottom:1px solid #eee"'
MAX_SERIES = 6

Series = Mapping[str, Sequence[tuple[float, float]]]  # metric -> [(step, value), ...]


def _fmt_elapsed(s: float) -> str:
    s = max(0.0, s)
    if s < 60:
        return f"{s:.1f}s"
    m, s = divmod(int(s), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def _badge(state: str) -> str:
    color = _STATE_COLOR.get(state, "#888")
    return f'<span style="color:{color};font-weight:bold">{escape(state)}</span>'


def _exit_text(exitcode: int | None, signal: str | None) -> str:
    if exitcode is None:
        return ""
    return escape(signal) if signal else str(exitcode)


def _fmt_num(v: float) -> str:
    return f"{v:.4g}"


def svg_chart(series: Series, width: int = 420, height: int = 150) -> str:
    """A line chart of each metric against its step (at most ``MAX_SERIES`` lines)."""
    pts = {k: sorted(v) for k, v in sorted(series.items()) if v}
    pts = dict(list(pts.items())[:MAX_SERIES])
    if not pts:
        return ""
    xs = [x for v in pts.values() for x, _ in v]
    ys = [y for v in pts.values() for _, y in v]
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    if x1 == x0:
        x1 = x0 + 1
    if y1 == y0:
        y0, y1 = y0 - 0.5, y1 + 0.5
    left, right, top, bottom = 48, 8, 8, 20
    pw, ph = width - left - right, height - top - bottom

    def sx(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * pw

    def sy(y: float) -> float:
        return top + (1 - (y - y0) / (y1 - y0)) * ph

    parts = [
        f'<svg class="gangrun-chart" xmlns="http://www.w3.org/2000/svg" width="{width}" '
        f'height="{height}" viewBox="0 0 {width} {height}" style="font:10px sans-serif">',
        f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#ccc"/>',
        f'<text x="{left - 4}" y="{top + 8}" text-anchor="end">{_fmt_num(y1)}</text>',
        f'<text x="{left - 4}" y="{top + ph}" text-anchor="end">{_fmt_num(y0)}</text>',
        f'<text x="{left}" y="{height - 6}">step {_fmt_num(x0)}</text>',
        f'<text x="{left + pw}" y="{height - 6}" text-anchor="end">{_fmt_num(x1)}</text>',
    ]
    for i, (name, v) in enumerate(pts.items()):
        color = _COLORS[i % len(_COLORS)]
        coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in v)
        title = f"<title>{escape(name)}</title>"
        if len(v) == 1:
            cx, cy = sx(v[0][0]), sy(v[0][1])
            parts.append(
                f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="2.5" fill="{color}">{title}</circle>'
            )
        else:
            parts.append(
                f'<polyline class="gangrun-series" fill="none" stroke="{color}" '
                f'stroke-width="1.5" points="{coords}">{title}</polyline>'
            )
    parts.append("</svg>")
    legend = " ".join(
        f'<span style="color:{_COLORS[i % len(_COLORS)]}">&#9632; {escape(k)} '
        f"{_fmt_num(v[-1][1])}</span>"
        for i, (k, v) in enumerate(pts.items())
    )
    return "".join(parts) + f'<div style="font-size:11px">{legend}</div>'


def _link(snap: CallSnapshot) -> str:
    if not snap.mlflow_run_id:
        return ""
    url = snap.run_url
    rid = escape(snap.mlflow_run_id)
    if url:
        return f'MLflow run <a href="{escape(url)}" target="_blank">{rid}</a>'
    where = f" on {escape(snap.tracking_uri)}" if snap.tracking_uri else ""
    return f"MLflow run <code>{rid}</code>{where}"


def render_panel(snap: CallSnapshot, series: Series | None = None) -> str:
    """The panel of one call: header, one row per rank, the metrics chart."""
    state = snap.final or ("running" if snap.attempt or snap.message == "running" else "starting")
    attempt = f" · attempt {snap.attempt + 1}/{snap.max_restarts + 1}" if snap.max_restarts else ""
    if snap.resumed_from is not None:  # "attempt 2/4, resumed from step 1200"
        attempt += f"{',' if attempt else ' ·'} resumed from step {snap.resumed_from}"
    head = [
        f"<b>{escape(snap.fn_name)}</b>",
        _badge(state),
        f"{snap.world_size} rank{'s' if snap.world_size != 1 else ''}",
        f'<span class="gangrun-elapsed">{_fmt_elapsed(snap.elapsed)}</span>{attempt}',
    ]
    link = _link(snap)
    rows = "".join(
        f'<tr class="gangrun-rank" data-rank="{v.rank}" data-state="{escape(v.state)}">'
        f"<td {_TD}>rank {v.rank}</td><td {_TD}>{_badge(v.state)}</td>"
        f"<td {_TD}>{_exit_text(v.exitcode, v.signal)}</td>"
        f'<td {_TD}><code style="white-space:pre">{escape(v.last_line)}</code></td></tr>'
        for v in snap.ranks
    )
    msg = ""
    if snap.message and snap.message not in ("running", "finished"):
        msg = f'<div class="gangrun-message">{escape(snap.message)}</div>'
    chart = svg_chart(series or {})
    return (
        f'<div class="gangrun-panel" data-final="{escape(snap.final or "")}" '
        'style="border:1px solid #ddd;border-radius:4px;padding:6px 8px;margin:4px 0;'
        'font-family:sans-serif;font-size:12px">'
        f"<div>{' · '.join(head)}</div>"
        + (f"<div>{link}</div>" if link else "")
        + msg
        + '<table style="border-collapse:collapse;margin:4px 0">'
        f"<tr><th {_TD}>rank</th><th {_TD}>state</th><th {_TD}>exit</th>"
        f"<th {_TD}>last line</th></tr>{rows}</table>" + chart + "</div>"
    )


def handle_html(handle: Any) -> str:
    """``RunHandle._repr_html_``: state, ranks, run link."""
    done = bool(getattr(handle, "done", lambda: False)())
    state = "done" if done else "running"
    run = getattr(handle, "_run", None)
    fn = getattr(run, "fn_name", "?")
    mlflow_id = getattr(handle, "mlflow_run_id", None)
    rows = [
        ("state", _badge(state)),
        ("ranks", str(getattr(handle, "world_size", "?"))),
        ("call", f"<code>{escape(str(getattr(handle, 'run_id', '?')))}</code>"),
    ]
    if mlflow_id:
        rows.append(("MLflow run", f"<code>{escape(str(mlflow_id))}</code>"))
    log_dir = getattr(handle, "log_dir", None)
    if log_dir:
        rows.append(("logs", f"<code>{escape(str(log_dir))}</code>"))
    body = "".join(f"<tr><td {_TD}>{k}</td><td {_TD}>{v}</td></tr>" for k, v in rows)
    return (
        f'<div class="gangrun-handle"><b>RunHandle</b> {escape(str(fn))}'
        f'<table style="border-collapse:collapse">{body}</table></div>'
    )


def _failure_block(f: Any) -> str:
    rank = getattr(f, "rank", None)
    code = getattr(f, "exitcode", None)
    sig = getattr(f, "signal", None)
    what = getattr(f, "exc_type", None) or (f"signal {sig}" if sig else f"exit code {code}")
    msg = str(getattr(f, "message", "") or "").strip()
    head = f"rank {rank}: {what}" + (f": {msg.splitlines()[0]}" if msg else "")
    tb = escape(getattr(f, "traceback", None) or "")
    return f'<summary>{escape(head)}</summary><pre style="white-space:pre-wrap">{tb}</pre>'


def error_html(err: BaseException) -> str:
    """``DistributedError._repr_html_``: the root cause first, other ranks' failures folded."""
    text = str(err)
    first, _, rest = text.partition("\n")
    rank = getattr(err, "rank", None)
    parts = [
        '<div class="gangrun-error" style="font-family:sans-serif;font-size:12px">',
        f'<div style="color:#d62728;font-weight:bold">{escape(type(err).__name__)}: '
        f"{escape(first)}</div>",
    ]
    if rest.strip():
        parts.append(f'<pre style="white-space:pre-wrap">{escape(rest.strip())}</pre>')
    failures = getattr(err, "failures", None) or {}
    others = [f for r, f in sorted(failures.items()) if r != rank]
    if others:
        parts.append(f"<details><summary>{len(others)} other rank failure(s)</summary>")
        parts.extend(f"<details>{_failure_block(f)}</details>" for f in others)
        parts.append("</details>")
    run_id = getattr(err, "run_id", None)
    if run_id:
        parts.append(f"<div>call <code>{escape(str(run_id))}</code></div>")
    parts.append("</div>")
    return "".join(parts)


__all__ = ["render_panel", "svg_chart", "handle_html", "error_html"]
