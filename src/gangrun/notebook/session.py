"""The seams between a call and the notebook: what ``submit()`` and the decorator call.

`attach` runs in ``submit()`` (the launching cell's thread): in a kernel it binds the
call's stdout/stderr to that cell and, unless turned off, gives the call a `CallState`
whose observer is the live panel. Outside a kernel it does nothing.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from ..lifecycle.observers import CallInfo, Observer
from ..lifecycle.state import Outcome, State
from . import kernel
from .state import CallState

if TYPE_CHECKING:
    from ..lifecycle.supervisor import Supervisor
    from ..options import Options


def panel_wanted(opts: Options) -> bool:
    return bool(getattr(opts, "progress", True)) and getattr(opts, "output", "all") != "none"


class PanelObserver(Observer):
    """The lifecycle's observer that feeds a call's `CallState` (and so its panel)."""

    def __init__(self, state: CallState, run: Supervisor) -> None:
        self.state, self.run = state, run
        self._tracked = False
        from .resumed import ResumeWatch

        self._resume = ResumeWatch(state, run)  # "resumed from step N" from the step reports

    def on_plan(self, call: CallInfo) -> None:
        self.state.starting(call.world_size, call.run_id)  # before the slow parts (MLflow)

    def on_transition(self, state: State, outcome: Outcome, call: CallInfo) -> None:
        cs = self.state
        if state is State.RUNNING:
            tracker = self.run.tracker
            if tracker is not None and not self._tracked:
                self._tracked = True
                cs.tracking(tracker.run_id, tracker.tracking_uri, tracker.experiment_id)
            cs.attempt_started(call.attempt)
            self._resume.start()
        elif state.terminal:
            self._resume.stop()
            watch = getattr(self.run, "watch", None)
            if watch is not None:
                watch.freeze()  # the final draw shows the last step reports, not a cached read
            cs.ended(outcome.mlflow_status or "FAILED", outcome.error)

    def on_rank_exit(self, rank: int, exitcode: int, stopped: bool) -> None:
        self.state.rank_exit(rank, exitcode, stopped)

    def on_rank_line(self, rank: int, text: str) -> None:
        self.state.rank_line(rank, text)


def attach(run: Supervisor, opts: Options) -> CallState | None:
    """In a kernel: route the call's output to the launching cell and give it a live panel
    (an observer of its lifecycle); returns the panel's ``CallState`` (or ``None``)."""
    k = kernel()
    if k is None:
        return None
    from .routing import cell_writer, current_parent

    if run.stdout is sys.stdout:
        run.stdout = run.call.stdout = cell_writer(sys.stdout)
    if run.stderr is sys.stderr:
        run.stderr = run.call.stderr = cell_writer(sys.stderr)
    if not panel_wanted(opts):
        return None
    from IPython import get_ipython

    from .panel import Panel

    shell = get_ipython()
    parent = current_parent(getattr(shell, "display_pub", None)) or current_parent(sys.stdout)
    watch = getattr(run, "watch", None)  # progress, slow and silent ranks (lifecycle/watch.py)
    panel = Panel(shell, parent, progress=None if watch is None else watch.progress)
    state = CallState(run.fn_name, run.run_id, opts.max_restarts, [panel])
    run.observers.insert(0, PanelObserver(state, run))
    return state


def on_decorate(opts: Options) -> None:
    """A function was decorated: in a kernel, warm the fork server for its first call."""
    if getattr(opts, "backend", "local") != "local" or getattr(opts, "start_method", "") == "spawn":
        return
    if kernel() is None:
        return
    from .warm import prewarm_soon

    prewarm_soon()


__all__ = ["attach", "on_decorate", "panel_wanted"]
