"""The call's lifecycle as an explicit state machine: states, typed events, the outcome.

::

    PLANNING -> LAUNCHING -> RUNNING -> STOPPING -> SUCCEEDED | FAILED | CANCELLED
                   ^                       |                    | TIMED_OUT | HUNG
                   +------ RESTARTING <----+

Any state that is not terminal may also end in FAILED (a launch failure, or a bug in gangrun
itself: the call still ends, and nothing is left running). An illegal transition is a bug in
gangrun and raises `IllegalTransition`.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import DistributedError
from ..launch import RankExit
from ..wire.call import ENDED
from ..wire.records import RankFailure


class State(enum.Enum):
    PLANNING = "planning"
    LAUNCHING = "launching"
    RUNNING = "running"
    STOPPING = "stopping"
    RESTARTING = "restarting"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TIMED_OUT = "timed_out"
    HUNG = "hung"

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL


# the ends, as the node's call record names them (`gangrun ps` tells an ended call by them)
_TERMINAL = frozenset(State(name) for name in ENDED)

TRANSITIONS: dict[State, frozenset[State]] = {
    State.PLANNING: frozenset({State.LAUNCHING, State.FAILED, State.CANCELLED}),
    State.LAUNCHING: frozenset({State.RUNNING, State.FAILED, State.CANCELLED}),
    State.RUNNING: frozenset({State.STOPPING, State.FAILED}),
    State.STOPPING: _TERMINAL | {State.RESTARTING},
    # a back-off wait (lifecycle/attempts.py) may end in a cancel or the call's deadline
    State.RESTARTING: frozenset({State.LAUNCHING, State.FAILED, State.CANCELLED, State.TIMED_OUT}),
}

# What each terminal state means for the MLflow run.
MLFLOW_STATUS = {
    State.SUCCEEDED: "FINISHED",
    State.FAILED: "FAILED",
    State.HUNG: "FAILED",
    State.CANCELLED: "KILLED",
    State.TIMED_OUT: "KILLED",
}


class IllegalTransition(RuntimeError):
    """A transition the lifecycle does not allow: a bug in gangrun."""


# ---------------------------------------------------------------------------- events
@dataclass(frozen=True)
class RankExited:
    exit: RankExit

    @property
    def rank(self) -> int:
        return self.exit.rank


@dataclass(frozen=True)
class CancelRequested:
    reason: str  # "cancelled", "interrupted", "stopped because the caller is exiting"...


@dataclass(frozen=True)
class PreemptRequested:
    """A preemption (``cancel(checkpoint=True)``, SIGTERM to the caller): it wakes a back-off
    wait, which then ends the call; a running attempt ignores it (its ranks save and stop)."""


@dataclass(frozen=True)
class DeadlineReached:
    timeout: float  # the call's timeout, which ran out


@dataclass(frozen=True)
class HangDetected:
    ranks: list[int]  # without progress for hang_timeout


@dataclass(frozen=True)
class LaunchFailed:
    exc: BaseException


Event = (
    RankExited | CancelRequested | PreemptRequested | DeadlineReached | HangDetected | LaunchFailed
)


# ---------------------------------------------------------------------------- outcome
class Decision(enum.Enum):
    """What the restart policy decided after an attempt (`gangrun.lifecycle.policy.Verdict`)."""

    RESTART = "restart"
    STOP = "stop"


@dataclass
class Attempt:
    """One attempt (the first launch or a restart) and how it ended."""

    number: int
    state: State = State.RUNNING  # the state it ended in (RUNNING while it runs)
    error: BaseException | None = None
    failures: dict[int, RankFailure] = field(default_factory=dict)
    # filled in by lifecycle/attempts.py once it ended: when, the ranks' progress, what next
    started: float = 0.0  # time.time() of the launch, and of the end
    ended: float = 0.0
    resumed_from: int | None = None  # the step a restore resumed at (progress reports)
    last_step: int | None = None  # the highest step a rank reported
    world_size: int = 0  # how many ranks it ran (a run_id= resume may run another number)
    decision: Decision | None = None  # restart or stop, and why (policy.Verdict)
    reason: str = ""
    backoff: float = 0.0  # seconds waited before the next attempt


@dataclass
class Outcome:
    """Where the call stands (final once ``state`` is terminal)."""

    state: State = State.PLANNING
    results: list[Any] | None = None
    error: BaseException | None = None
    attempts: list[Attempt] = field(default_factory=list)

    @property
    def failures(self) -> dict[int, RankFailure]:
        """Every failed rank of the last attempt, keyed by rank."""
        if isinstance(self.error, DistributedError) and self.error.failures:
            return self.error.failures
        return self.attempts[-1].failures if self.attempts else {}

    @property
    def mlflow_status(self) -> str | None:
        """FINISHED, FAILED or KILLED once terminal; None while the call runs."""
        if not self.state.terminal:
            return None
        if self.state is State.FAILED and not isinstance(self.error, Exception):
            return "KILLED"  # a KeyboardInterrupt while starting: the user stopped it
        return MLFLOW_STATUS[self.state]


class StateMachine:
    """Holds the state; validates each transition and tells the listener."""

    def __init__(
        self, outcome: Outcome, listener: Callable[[State, Outcome], None] | None = None
    ) -> None:
        self.outcome = outcome
        self._listener = listener
        self._lock = threading.Lock()

    @property
    def state(self) -> State:
        return self.outcome.state

    def to(self, new: State) -> None:
        with self._lock:
            old = self.outcome.state
            if new not in TRANSITIONS.get(old, frozenset()):
                raise IllegalTransition(f"illegal lifecycle transition {old.value} -> {new.value}")
            self.outcome.state = new
        if self._listener is not None:
            self._listener(new, self.outcome)


__all__ = [
    "State",
    "TRANSITIONS",
    "IllegalTransition",
    "RankExited",
    "CancelRequested",
    "PreemptRequested",
    "DeadlineReached",
    "HangDetected",
    "LaunchFailed",
    "Event",
    "Attempt",
    "Outcome",
    "StateMachine",
]
