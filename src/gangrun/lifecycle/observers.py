"""Observers of a call: told of every lifecycle transition, with the outcome so far.

Adding one is a class with the hooks it needs (`Observer` has no-op defaults) passed
to the supervisor. Today: MLflow tracking (`MlflowObserver`) and the printed notices
(`NoticeObserver`); a notebook panel would be a third.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any

from .state import Outcome, State

if TYPE_CHECKING:
    from ..tracking.caller import Tracker
    from ..tracking.plan import TrackingInfo

log = logging.getLogger("gangrun.lifecycle.observers")


@dataclass
class CallInfo:
    """What observers know of the call (filled in as the supervisor learns it)."""

    run_id: str
    fn_name: str
    world_size: int = 0
    attempt: int = 0
    max_restarts: int = 0
    log_files: dict[int, str] = field(default_factory=dict)
    tracking: TrackingInfo | None = None  # params/tags for the MLflow run (set by the plan)
    stdout: IO[str] | None = None
    stderr: IO[str] | None = None


class Observer:
    """Base class: override what you need. Hooks must not raise (the supervisor logs and
    carries on if one does: an observer never changes how the call ends)."""

    def on_transition(self, state: State, outcome: Outcome, call: CallInfo) -> None:
        """Called after every transition into ``state``."""

    def rank_env(self) -> dict[str, str]:
        """Variables every rank gets (asked before each launch)."""
        return {}

    def on_plan(self, call: CallInfo) -> None:
        """The call is planned (its id and world size are known); nothing is acquired yet."""

    def on_rank_exit(self, rank: int, exitcode: int, stopped: bool) -> None:
        """Rank ``rank`` ended (``stopped``: during the teardown, i.e. it was stopped)."""

    def on_rank_line(self, rank: int, text: str) -> None:
        """The newest line (or progress frame) a rank printed. Only called for observers that
        override it: the output pump then reports lines (once per read, not per line)."""

    @property
    def wants_lines(self) -> bool:
        return type(self).on_rank_line is not Observer.on_rank_line


class MlflowObserver(Observer):
    """One MLflow run per call: created by `start` as the last acquisition before the
    first launch (its link printed), ended with the outcome's status (logs attached) when the
    call reaches a terminal state."""

    def __init__(self, start: Callable[[TrackingInfo, Any], Any] | None = None) -> None:
        self._start = start
        self.tracker: Tracker | None = None  # once started

    @property
    def run_id(self) -> str | None:
        return None if self.tracker is None else str(self.tracker.run_id)

    def start(self, call: CallInfo) -> None:
        """Create (or resume) the call's run: an acquisition of the supervisor's, so bad
        tracking input (a missing ``run_id``...) is a ``LaunchError`` before any rank starts."""
        start = self._start
        if start is None:
            from ..tracking import Tracker

            start = Tracker.start
        assert call.tracking is not None  # the plan made it before the first launch
        self.tracker = start(call.tracking, call.stdout)

    def on_transition(self, state: State, outcome: Outcome, call: CallInfo) -> None:
        # with restarts, or on a resumed run (the earlier call's attempts no longer apply)
        tracked = call.max_restarts > 0 or bool(getattr(self.tracker, "resume_number", 0))
        if self.tracker is not None and tracked and (state.terminal or state is State.RESTARTING):
            from .attempts import record_mlflow  # every attempt in this one run

            try:
                record_mlflow(self.tracker, outcome.attempts, final=state.terminal)
            except Exception as exc:
                print(f"gangrun: could not record the attempts on MLflow: {exc}", file=call.stderr)
        if state.terminal and self.tracker is not None:
            status = outcome.mlflow_status or "FAILED"
            try:
                self.tracker.finish(status, outcome.error, call.log_files)
            except Exception as exc:
                print(f"gangrun: could not finish the MLflow run: {exc}", file=call.stderr)

    def rank_env(self) -> dict[str, str]:
        return {} if self.tracker is None else dict(self.tracker.rank_env())


class NoticeObserver(Observer):
    """The one-line notices users see in the cell: restarts."""

    def on_transition(self, state: State, outcome: Outcome, call: CallInfo) -> None:
        if state is State.RESTARTING and outcome.attempts:
            last = outcome.attempts[-1]
            err = last.error
            first = str(err.args[0]).splitlines()[0] if err is not None and err.args else ""
            wait = f" in {last.backoff:g}s" if last.backoff > 0 else ""
            print(
                f"gangrun: {first} Restarting the gang (restart {call.attempt + 1}/"
                f"{call.max_restarts}){wait}.",
                file=call.stderr,
            )


def tell(observers: list[Observer], hook: str, *args: Any) -> None:
    """Call ``hook`` on every observer; one that raises is logged and skipped."""
    for obs in observers:
        try:
            getattr(obs, hook)(*args)
        except Exception:
            log.exception("observer %r failed in %s", obs, hook)


def notify(observers: list[Observer], state: State, outcome: Outcome, call: CallInfo) -> None:
    """Tell every observer; one that raises is logged and skipped: an observer never changes
    how the call ends (MLflow's own start-up problems are a printed note of the tracker's)."""
    for obs in observers:
        try:
            obs.on_transition(state, outcome, call)
        except Exception:
            log.exception("observer %r failed on %s", obs, state.value)


__all__ = ["CallInfo", "Observer", "MlflowObserver", "NoticeObserver", "notify", "tell"]
