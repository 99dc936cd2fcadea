"""Observers of a call: one typed method per event, handed to the supervisor when it is made.

`Observer` is the one protocol (as Ray Train v2's ``ControllerCallback``): a base class
whose methods do nothing; an observer overrides those it needs. The supervisor calls them
directly, through `Observers`, which logs and skips an observer that raises: an observer
never changes how the call ends. Every observer is given at construction (the built-in
ones, the notebook panel, the user's ``observers=``); the list never changes afterwards.

Built in: the DEBUG narration, the progress, the node record (`gangrun.lifecycle.watch`),
`MlflowObserver` (the MLflow run's status, attempts and logs at the end: the run itself is
an acquisition of the supervisor's, so ``observers=`` never turns MLflow off) and
`NoticeObserver` (the printed restart notices).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import IO, TYPE_CHECKING, Protocol, TypedDict

from .record import CallerKind, CallRecord
from .state import Outcome, State

if TYPE_CHECKING:
    from ..host.accelerators import Accelerator
    from ..launch import Gang
    from ..progress_view import Progress
    from ..tracking.caller import Tracker

log = logging.getLogger("gangrun.lifecycle.observers")


class Watching(Protocol):
    """The call's progress and stacks (`gangrun.lifecycle.watch.Watch`)."""

    def progress(self, fresh: bool = False) -> Progress: ...
    def freeze(self) -> Progress: ...
    def stacks(self, wait: float = 5.0) -> dict[int, str]: ...


class CallView(Protocol):
    """What an observer reads of its call: the record, and what the supervisor holds now."""

    @property
    def call(self) -> CallRecord: ...
    @property
    def outcome(self) -> Outcome: ...
    @property
    def state(self) -> State: ...
    @property
    def attempt(self) -> int: ...  # 0: the first
    @property
    def run_dir(self) -> str: ...  # "" until acquired
    @property
    def log_dir(self) -> str: ...
    @property
    def owner_pid(self) -> int: ...
    @property
    def tracker(self) -> Tracker | None: ...  # the MLflow run, once created
    @property
    def watch(self) -> Watching: ...
    @property
    def gang(self) -> Gang | None: ...  # the running attempt's
    @property
    def devices(self) -> list[Accelerator]: ...  # the GPUs reserved
    def log_files(self) -> dict[int, str]: ...
    def done(self) -> bool: ...
    def cancel(
        self, reason: str = "cancelled", wait: float = 30.0, checkpoint: bool = False
    ) -> bool: ...


class Observer:
    """Base class: override what you need. Hooks must be quick and must not raise (one that
    raises is logged; the call goes on and ends as it would have)."""

    def on_plan(self, run: CallView) -> None:
        """The call starts: ``run.call`` (run id, world size, options) is known, nothing is
        acquired yet. ``run`` stays valid: keep it to read the run directory, the MLflow run
        or the progress later."""

    def on_transition(self, state: State, run: CallView) -> None:
        """The call went into ``state`` (``run.outcome``: the attempts and error so far)."""

    def on_rank_exit(self, rank: int, exitcode: int, stopped: bool) -> None:
        """Rank ``rank`` ended (``stopped``: during the teardown, i.e. it was stopped)."""

    def on_rank_line(self, rank: int, text: str) -> None:
        """The newest line (or progress frame) a rank printed. Only called when some observer
        overrides it: the output pump then reports lines (once per read, not per line)."""


def wants_lines(obs: Observer) -> bool:
    return type(obs).on_rank_line is not Observer.on_rank_line


@contextlib.contextmanager
def _guarded(obs: Observer, event: str) -> Iterator[None]:
    try:
        yield
    except Exception:
        log.exception("observer %r failed in %s", obs, event)


class Observers(Observer):
    """Every observer of one call, told in order, each call guarded (fixed at construction)."""

    def __init__(self, observers: Sequence[Observer]) -> None:
        self.all: tuple[Observer, ...] = tuple(observers)
        self.line_listeners = tuple(o for o in self.all if wants_lines(o))

    def on_plan(self, run: CallView) -> None:
        for obs in self.all:
            with _guarded(obs, "on_plan"):
                obs.on_plan(run)

    def on_transition(self, state: State, run: CallView) -> None:
        for obs in self.all:
            with _guarded(obs, f"on_transition({state.value})"):
                obs.on_transition(state, run)

    def on_rank_exit(self, rank: int, exitcode: int, stopped: bool) -> None:
        for obs in self.all:
            with _guarded(obs, "on_rank_exit"):
                obs.on_rank_exit(rank, exitcode, stopped)

    def on_rank_line(self, rank: int, text: str) -> None:
        for obs in self.line_listeners:
            with _guarded(obs, "on_rank_line"):
                obs.on_rank_line(rank, text)


class Wiring(TypedDict, total=False):
    """What a call is wired with by whoever makes it, for good (keyword arguments of
    ``Supervisor(...)``): where its output goes, who observes it, what made it. The notebook
    gives the cell's writers, the panel and ``"kernel"``; ``gangrun run`` its status-line
    streams and ``"gangrun run"``; a script gives nothing (``sys.stdout``/``sys.stderr``)."""

    stdout: IO[str]
    stderr: IO[str]
    observers: Sequence[Observer]
    caller: CallerKind


class MlflowObserver(Observer):
    """The MLflow side of the call's end: the attempts (with restarts, or on a resumed run),
    then the run ended with the outcome's status and the rank logs attached. The run is
    created by the supervisor's acquisition (`gangrun.lifecycle.seams.start_tracking`)."""

    def on_transition(self, state: State, run: CallView) -> None:
        tracker = run.tracker
        if tracker is None or not (state.terminal or state is State.RESTARTING):
            return
        outcome, stderr = run.outcome, run.call.stderr
        # with restarts, or on a resumed run (the earlier call's attempts no longer apply)
        if run.call.max_restarts > 0 or tracker.resume_number:
            from .attempts import record_mlflow  # every attempt in this one run

            try:
                record_mlflow(tracker, outcome.attempts, final=state.terminal)
            except Exception as exc:
                print(f"gangrun: could not record the attempts on MLflow: {exc}", file=stderr)
        if state.terminal:
            try:
                tracker.finish(outcome.mlflow_status or "FAILED", outcome.error, run.log_files())
            except Exception as exc:
                print(f"gangrun: could not finish the MLflow run: {exc}", file=stderr)


class NoticeObserver(Observer):
    """The one-line notices users see in the cell: restarts."""

    def on_transition(self, state: State, run: CallView) -> None:
        attempts = run.outcome.attempts
        if state is State.RESTARTING and attempts:
            last = attempts[-1]
            err = last.error
            first = str(err.args[0]).splitlines()[0] if err is not None and err.args else ""
            wait = f" in {last.backoff:g}s" if last.backoff > 0 else ""
            print(
                f"gangrun: {first} Restarting the gang (restart {run.attempt + 1}/"
                f"{run.call.max_restarts}){wait}.",
                file=run.call.stderr,
            )


__all__ = [
    "CallRecord",
    "CallView",
    "Observer",
    "Observers",
    "MlflowObserver",
    "NoticeObserver",
    "Watching",
    "Wiring",
    "wants_lines",
]
