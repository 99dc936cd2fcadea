"""The live panel of a call made from a Jupyter kernel: an observer of the call's lifecycle.

`Panel` is a `gangrun.lifecycle.observers.Observer`, handed to the call's supervisor when it is
made (`gangrun.notebook.session.wiring`). Drawn with IPython's rich display (``display(...,
display_id=...)`` then updates in place: no ipywidgets, so JupyterLab, classic Notebook, VS
Code and saved notebooks all show it). Its hooks only update the snapshot (`CallState`); the
panel's own thread redraws at most every ``refresh_s`` and reads the call's MLflow metrics at
most every ``metrics_s``, so nothing of it runs on the training path. The end is drawn
synchronously, before the call is reported done, so the saved notebook holds it.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any

from ..lifecycle.observers import CallView, Observer
from ..lifecycle.state import State
from ..progress_view import Progress
from ..wire.tags import METRIC_PREFIX
from .html import MAX_SERIES, Series, render_panel, svg_chart
from .routing import parent_of
from .state import CallSnapshot, CallState

log = logging.getLogger("gangrun.notebook")

MAX_POINTS = 20_000  # raw values per metric read (the newest); the chart merges them


def fetch_metrics(
    tracking_uri: str | None, run_id: str
) -> tuple[dict[str, list[tuple[float, float]]], dict[str, float]]:
    """The run's metric histories (the first ``MAX_SERIES`` by name: every rank's values,
    the chart grid merges them per step) and the last value of the others; ``({}, {})`` when
    unreadable. gangrun's own final values (``gangrun.*``) are not charted."""
    try:
        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri=tracking_uri)
        latest = {
            k: float(v)
            for k, v in client.get_run(run_id).data.metrics.items()
            if not k.startswith(METRIC_PREFIX)
        }
        names = sorted(latest)
        out: dict[str, list[tuple[float, float]]] = {}
        for name in names[:MAX_SERIES]:
            hist = client.get_metric_history(run_id, name)
            pts = sorted((float(m.step), float(m.value)) for m in hist)
            out[name] = pts[-MAX_POINTS:]
        return out, {k: latest[k] for k in names[MAX_SERIES:]}
    except Exception as exc:  # the store is busy or gone: the panel just keeps its last chart
        log.debug("panel: cannot read the metrics of run %s: %s", run_id, exc)
        return {}, {}


def _plain(snap: CallSnapshot) -> str:
    state = snap.final or snap.message or "running"
    return f"gangrun: {snap.fn_name} · {state} · {snap.world_size} ranks · {snap.elapsed:.1f}s"


class Panel(Observer):
    """The observer that draws one call's panel in the cell that launched it."""

    def __init__(
        self,
        shell: Any,
        parent: dict[str, Any] | None,
        refresh_s: float = 0.5,
        metrics_s: float = 2.5,
    ) -> None:
        self.shell = shell
        self.parent = parent
        self.refresh_s = refresh_s
        self.metrics_s = metrics_s
        self.display_id = f"gangrun-{uuid.uuid4().hex}"
        self.series: Series = {}
        self.more: dict[str, float] = {}
        self._grid = ""  # the chart grid's HTML, drawn once per metrics read (not per redraw)
        self.renders = 0
        self._run: CallView | None = None  # the call, from on_plan
        self._state: CallState | None = None
        self._tracked = False
        self._snap: CallSnapshot | None = None
        self._shown = False
        self._dirty = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()  # one draw at a time
        self._thread: threading.Thread | None = None

    # -- the call's lifecycle -------------------------------------------------------------
    def on_plan(self, run: CallView) -> None:
        self._run = run
        self._state = state = CallState(run.call, self._changed)
        state.starting()  # before the slow parts (MLflow, the fork server)

    def on_transition(self, state: State, run: CallView) -> None:
        cs = self._state
        if cs is None:
            return
        if state is State.RUNNING:
            tracker = run.tracker
            if tracker is not None and not self._tracked:
                self._tracked = True
                cs.tracking(tracker.run_id, tracker.tracking_uri, tracker.experiment_id)
            cs.attempt_started(run.attempt)
        elif state.terminal:
            run.watch.freeze()  # the final draw shows the last step reports, not a cached read
            cs.ended(run.outcome.mlflow_status or "FAILED", run.outcome.error)

    def on_rank_exit(self, rank: int, exitcode: int, stopped: bool) -> None:
        if self._state is not None:
            self._state.rank_exit(rank, exitcode, stopped)

    def on_rank_line(self, rank: int, text: str) -> None:
        if self._state is not None:
            self._state.rank_line(rank, text)

    def _changed(self, snap: CallSnapshot) -> None:
        if snap.final is not None:
            self._end(snap)
        elif not self._shown and self._thread is None:
            self._begin(snap)
        else:
            self._snap = snap
            self._dirty.set()

    def _progress(self) -> Progress | None:
        # the call's one reading of the step reports (`gangrun.lifecycle.watch.Watch`): the
        # progress line, the ranks' steps and "resumed from step N" all come from it
        return None if self._run is None else self._run.watch.progress()

    # -- drawing -------------------------------------------------------------------------
    def _draw(self, snap: CallSnapshot) -> None:
        from IPython.display import display

        progress = None
        try:
            progress = self._progress()
        except Exception:  # the run directory is going away: draw without it
            log.debug("panel: no progress", exc_info=True)
        html = render_panel(snap, progress=progress, grid=self._grid)
        bundle = {"text/html": html, "text/plain": _plain(snap)}
        with self._lock, parent_of(self.parent, getattr(self.shell, "display_pub", None)):
            display(bundle, raw=True, display_id=self.display_id, update=self._shown)
            self._shown = True
            self.renders += 1

    # -- the snapshot's changes --------------------------------------------------------------
    def _begin(self, snapshot: CallSnapshot) -> None:
        self._snap = snapshot
        self._draw(snapshot)  # "starting N ranks…" at once
        self._thread = threading.Thread(target=self._loop, name="gangrun-panel", daemon=True)
        self._thread.start()

    def _end(self, snapshot: CallSnapshot) -> None:
        self._snap = snapshot
        self._stop.set()
        self._dirty.set()
        if self._thread is not None:
            self._thread.join(5.0)
        if snapshot.mlflow_run_id:
            self._fetch(snapshot)
        try:
            self._draw(snapshot)  # frozen: the saved notebook shows the final state
        except Exception:
            log.exception("panel: the final draw failed")

    def _fetch(self, snap: CallSnapshot) -> None:
        assert snap.mlflow_run_id is not None
        series, more = fetch_metrics(snap.tracking_uri, snap.mlflow_run_id)
        if series or more:  # unreadable now: keep the last charts
            self.series, self.more = series, more
            self._grid = svg_chart(series, more)

    # -- the panel's thread ----------------------------------------------------------------
    def _loop(self) -> None:
        # on_start just drew: a short call is drawn twice only (start, end), and the first
        # redraw never competes with the ranks' start for the CPU
        last_draw = last_metrics = time.monotonic()
        try:
            while not self._stop.is_set():
                self._dirty.wait(self.refresh_s)
                if self._stop.is_set():
                    return
                now = time.monotonic()
                snap = self._snap
                if snap is None:
                    continue
                if snap.mlflow_run_id and now - last_metrics >= self.metrics_s:
                    last_metrics = now
                    self._fetch(snap)
                if now - last_draw < self.refresh_s:
                    # dirty, but drawn lately: sleep out the rest of the interval (waiting on
                    # the still-set event again would spin and steal the ranks' CPU)
                    self._stop.wait(self.refresh_s - (now - last_draw))
                    continue
                self._dirty.clear()
                if self._stop.is_set():
                    return
                last_draw = now
                self._draw(snap)  # also ticks the elapsed time
        except Exception:
            log.exception("panel: the live updates stopped")


__all__ = ["Panel", "fetch_metrics"]
