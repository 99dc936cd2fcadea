"""HTML of the live panel, of ``RunHandle`` and of ``DistributedError`` (``_repr_html_``).

Plain HTML and inline SVG with inline styles only: it renders in JupyterLab, classic
Notebook, VS Code and nbconvert's HTML, and survives in a saved notebook. Every piece of
text that comes from a rank, a user or MLflow is escaped.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from html import escape
from typing import TYPE_CHECKING, Protocol

from ..progress_view import NEAR_LIMIT_SHARE, Progress, fmt_duration, fmt_rate, summary_line
from ..wire.memory import nearest_limit
from ..wire.security import redact
from . import charts
from .state import CallSnapshot, RankView

if TYPE_CHECKING:
    from ..errors import DistributedError
    from ..wire.records import RankFailure

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
MAX_SERIES = charts.MAX_CHARTS

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


def svg_chart(series: Series, more: Mapping[str, float] | None = None) -> str:
    """The chart grid: one small chart per metric, own axes (`gangrun.notebook.charts`)."""
    return charts.grid(series, more)


def _link(snap: CallSnapshot) -> str:
    if not snap.mlflow_run_id:
        return ""
    url = snap.run_url
    rid = escape(snap.mlflow_run_id)
    if url:
        return f'MLflow run <a href="{escape(url)}" target="_blank">{rid}</a>'
    where = f" on {escape(redact(snap.tracking_uri))}" if snap.tracking_uri else ""
    return f"MLflow run <code>{rid}</code>{where}"


def header_lines(snap: CallSnapshot, progress: Progress | None = None) -> list[str]:
    """The panel's header, one HTML line each: the call (name, state, ranks, elapsed), then
    its progress when the ranks report steps."""
    state = snap.final or ("running" if snap.attempt or snap.message == "running" else "starting")
    attempt = f" · attempt {snap.attempt + 1}/{snap.max_restarts + 1}" if snap.max_restarts else ""
    resumed = progress.resumed_from if progress is not None else None
    if resumed is not None:  # "attempt 2/4, resumed from step 1200"
        attempt += f"{',' if attempt else ' ·'} resumed from step {resumed}"
        saved = progress.resumed_world if progress is not None else None
        if saved is not None:  # "... saved by 8 ranks onto 4"
            attempt += f" saved by {saved} ranks onto {snap.world_size}"
    head = [
        f"<b>{escape(snap.fn_name)}</b>",
        _badge(state),
        f"{snap.world_size} rank{'s' if snap.world_size != 1 else ''}",
        f'<span class="gangrun-elapsed">{_fmt_elapsed(snap.elapsed)}</span>{attempt}',
    ]
    lines = [" · ".join(head)]
    if progress is not None and progress.reported:
        text = summary_line(progress if snap.final is None else _final(progress))
        lines.append(f'<span class="gangrun-progress">{escape(text)}</span>')
    return lines


def _final(p: Progress) -> Progress:
    """At the end: no ETA, no silent marks (the ranks are gone)."""
    from dataclasses import replace

    ranks = {r: replace(v, silent_for=None) for r, v in p.ranks.items()}
    return replace(p, eta_s=None, ranks=ranks)


def _memory_cell(v: RankView, progress: Progress | None) -> tuple[str, str]:
    """(the row's attributes, the memory cell's HTML): the rank's last memory sample, in
    bold red for the rank nearest its limit once it is within 20% of it."""
    mem = progress.memory.get(v.rank) if progress is not None else None
    if mem is None:
        return "", ""
    attrs = f' data-rss="{mem.rss}"' + (f' data-limit="{mem.limit}"' if mem.limit else "")
    text = escape(mem.text())
    near = nearest_limit(progress.memory) if progress is not None else None
    if near is not None and near[0] == v.rank and (mem.share or 0) >= NEAR_LIMIT_SHARE:
        attrs += " data-nearest-limit"
        text = f'<span style="color:#d62728;font-weight:bold">{text}</span>'
    return attrs, text


def _rank_row(v: RankView, progress: Progress | None, live: bool) -> str:
    mem_attrs, mem = _memory_cell(v, progress)
    rp = progress.ranks.get(v.rank) if progress is not None else None
    step = rate = note = ""
    attrs = ""
    if rp is not None:
        if rp.step is not None:
            step = f"{rp.step}" + (f"/{rp.total}" if rp.total else "")
        rate = fmt_rate(rp.rate) if rp.rate is not None else ""
        if rp.slow_ratio is not None:
            attrs += f' data-slow="{rp.slow_ratio:.2f}"'
            note += (
                f'<span style="color:#b8860b;font-weight:bold">slow {rp.slow_ratio:.2f}x</span> '
            )
            if rp.slow_cause:
                note += f"({escape(rp.slow_cause)}) "
        if rp.silent_for is not None and live:
            attrs += f' data-silent="{rp.silent_for:.0f}"'
            note += (
                f'<span style="color:#d62728;font-weight:bold">silent '
                f"{fmt_duration(rp.silent_for)}</span> (<code>handle.stacks()</code> shows where) "
            )
    attrs += mem_attrs
    return (
        f'<tr class="gangrun-rank" data-rank="{v.rank}" data-state="{escape(v.state)}"{attrs}>'
        f"<td {_TD}>rank {v.rank}</td><td {_TD}>{_badge(v.state)}</td>"
        f"<td {_TD}>{_exit_text(v.exitcode, v.signal)}</td>"
        f"<td {_TD}>{step}</td><td {_TD}>{rate}</td><td {_TD}>{mem}</td>"
        f'<td {_TD}>{note}<code style="white-space:pre">{escape(v.last_line)}</code></td></tr>'
    )


def render_panel(
    snap: CallSnapshot,
    series: Series | None = None,
    more: Mapping[str, float] | None = None,
    progress: Progress | None = None,
    grid: str | None = None,
) -> str:
    """The panel of one call: header, one row per rank, the chart grid (``grid``: the grid's
    HTML drawn already, e.g. kept from the last metrics read; else drawn from ``series``)."""
    lines = header_lines(snap, progress)
    link = _link(snap)
    live = snap.final is None
    rows = "".join(_rank_row(v, progress, live) for v in snap.ranks)
    msg = ""
    if snap.message and snap.message not in ("running", "finished"):
        msg = f'<div class="gangrun-message">{escape(snap.message)}</div>'
    if grid is None:
        grid = svg_chart(series or {}, more)
    return (
        f'<div class="gangrun-panel" data-final="{escape(snap.final or "")}" '
        'style="border:1px solid #ddd;border-radius:4px;padding:6px 8px;margin:4px 0;'
        'font-family:sans-serif;font-size:12px">'
        + "".join(f"<div>{line}</div>" for line in lines)
        + (f"<div>{link}</div>" if link else "")
        + msg
        + '<table style="border-collapse:collapse;margin:4px 0">'
        f"<tr><th {_TD}>rank</th><th {_TD}>state</th><th {_TD}>exit</th>"
        f"<th {_TD}>step</th><th {_TD}>rate</th><th {_TD}>memory</th>"
        f"<th {_TD}>last line</th></tr>{rows}</table>" + grid + "</div><!--/gangrun-panel-->"
    )


class HandleView(Protocol):
    """What the handle's HTML shows of a `gangrun.api.RunHandle` (which imports this module)."""

    @property
    def fn_name(self) -> str: ...
    @property
    def world_size(self) -> int: ...
    @property
    def run_id(self) -> str: ...
    @property
    def mlflow_run_id(self) -> str | None: ...
    @property
    def log_dir(self) -> str: ...
    def done(self) -> bool: ...


def handle_html(handle: HandleView) -> str:
    """``RunHandle._repr_html_``: state, ranks, run link."""
    state = "done" if handle.done() else "running"
    fn = handle.fn_name
    mlflow_id = handle.mlflow_run_id
    rows = [
        ("state", _badge(state)),
        ("ranks", str(handle.world_size)),
        ("call", f"<code>{escape(handle.run_id)}</code>"),
    ]
    if mlflow_id:
        rows.append(("MLflow run", f"<code>{escape(str(mlflow_id))}</code>"))
    log_dir = handle.log_dir
    if log_dir:
        rows.append(("logs", f"<code>{escape(str(log_dir))}</code>"))
    body = "".join(f"<tr><td {_TD}>{k}</td><td {_TD}>{v}</td></tr>" for k, v in rows)
    return (
        f'<div class="gangrun-handle"><b>RunHandle</b> {escape(str(fn))}'
        f'<table style="border-collapse:collapse">{body}</table></div>'
    )


def _failure_block(f: RankFailure) -> str:
    sig = f.signal
    what = f.exc_type or (f"signal {sig}" if sig else f"exit code {f.exitcode}")
    msg = (f.message or "").strip()
    head = f"rank {f.rank}: {what}" + (f": {msg.splitlines()[0]}" if msg else "")
    tb = escape(f.traceback or "")
    return f'<summary>{escape(head)}</summary><pre style="white-space:pre-wrap">{tb}</pre>'


def error_html(err: DistributedError) -> str:
    """``DistributedError._repr_html_``: the root cause first, other ranks' failures folded."""
    text = str(err)
    first, _, rest = text.partition("\n")
    rank = err.rank
    parts = [
        '<div class="gangrun-error" style="font-family:sans-serif;font-size:12px">',
        f'<div style="color:#d62728;font-weight:bold">{escape(type(err).__name__)}: '
        f"{escape(first)}</div>",
    ]
    if rest.strip():
        parts.append(f'<pre style="white-space:pre-wrap">{escape(rest.strip())}</pre>')
    others = [f for r, f in sorted(err.failures.items()) if r != rank]
    if others:
        parts.append(f"<details><summary>{len(others)} other rank failure(s)</summary>")
        parts.extend(f"<details>{_failure_block(f)}</details>" for f in others)
        parts.append("</details>")
    if err.run_id:
        parts.append(f"<div>call <code>{escape(err.run_id)}</code></div>")
    parts.append("</div>")
    return "".join(parts)


__all__ = ["render_panel", "header_lines", "svg_chart", "handle_html", "error_html"]
