"""The restart policy: after an attempt ends, relaunch the gang (after a back-off) or stop.

The rules (docs/restarts.md, "Restart rules"), in the order they are applied:

1. A success, a timeout or a cancel is never retried: the call is over, or the user asked for
   it to end.
2. ``max_restarts`` restarts have been made: stop.
3. A failure *worth retrying* restarts: a rank killed by a signal or ending with an exit
   status but no Python exception (the OOM killer, a segfault, ``os._exit``), a hang caught by
   the guard, a lost Ray node, a collective timeout or a connection reset (the exception is
   a peer's echo or a network/timeout error: `gangrun.lifecycle.rootcause` holds the one list,
   `is_transient_exception`), unless its message says the backend is not available.
4. The rest is a Python exception raised by the root-cause rank. It is *certain to repeat*,
   and stops the restarts at once, when

   a. its message says the process group's backend is not available here
      (`UNAVAILABLE_TEXT`: a torch without NCCL, NCCL on a machine without GPUs), or
   b. the same exception type was raised from the same innermost frame of user code
      (file, line, function; `gangrun.wire.records.user_frame`) on the previous attempt, or
   c. it is not ``SystemExit`` and the attempt made no progress: no rank reported a step
      (``gangrun.report_step``) or a restore that loaded a checkpoint (the checkpoint
      manager's ``progress.report_resumed``; a restore that found none is not progress)
      before it failed (an ``ImportError``, a ``TypeError`` in the setup, a missing file),
      or
   d. the function returned a value that cannot be passed back
      (``ResultSerializationError``): the next attempt would return the same.

   Any other exception restarts (the first time it is raised at that line).

A restart waits ``restart_backoff * 2**(k-1)`` seconds before the k-th restart, at most
``restart_backoff_max`` (the first restart is quick; ``restart_backoff=0`` restarts at once).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import PEER_ECHO_TEXT
from .rootcause import (
    TRANSIENT_TEXT,
    TRANSIENT_TYPES,
    UNAVAILABLE_TEXT,
    any_of,
    is_transient_exception,
    unavailable_backend,
)
from .state import Decision, State

if TYPE_CHECKING:
    from ..options import Options


RETRYABLE = frozenset({State.FAILED, State.HUNG})

NEVER_REPEATS = frozenset({"ResultSerializationError"})


@dataclass(frozen=True)
class AttemptFacts:
    """What the policy knows of one ended attempt (process-free: built by
    `gangrun.lifecycle.attempts` from the root cause and the step reports)."""

    state: State
    exc_type: str | None = None  # the root cause's exception; None: signal, exit status, hang
    message: str = ""
    frame: str | None = None  # innermost user frame of that exception
    progressed: bool = False  # a rank reported a step or a completed restore

    @property
    def transient(self) -> bool:
        if self.state is State.HUNG or self.exc_type is None:
            return True
        return is_transient_exception(self.exc_type, self.message)

    @property
    def where(self) -> str:
        at = f" at {self.frame}" if self.frame else ""
        return f"{self.exc_type}{at}"


@dataclass(frozen=True)
class Verdict:
    """The decision after an attempt and why (``reason`` is a sentence for the error, the
    notice and the log; ``kind`` a stable word for tags and tests)."""

    decision: Decision
    kind: str  # restart | not_retryable | exhausted | unavailable | repeated | no_progress | result
    reason: str
    backoff: float = 0.0  # seconds to wait before the restart


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 0
    backoff: float = 1.0  # seconds before the first restart; doubled for each next one
    backoff_max: float = 60.0

    @classmethod
    def of(cls, options: Options) -> RestartPolicy:
        """The policy of a call's [`gangrun.Options`][gangrun.api.Options]."""
        return cls(options.max_restarts, options.restart_backoff, options.restart_backoff_max)

    def delay(self, restart: int) -> float:
        """Seconds to wait before restart number ``restart`` (1 for the first)."""
        if self.backoff <= 0 or restart < 1:
            return 0.0
        return float(min(self.backoff_max, self.backoff * 2 ** min(restart - 1, 62)))

    def decide(self, ended_in: State, restarts_so_far: int) -> Decision:
        """The state-only decision (no facts: every failure counts as worth retrying)."""
        return self.judge(AttemptFacts(ended_in), None, restarts_so_far).decision

    def judge(
        self, facts: AttemptFacts, previous: AttemptFacts | None, restarts_so_far: int
    ) -> Verdict:
        """Restart or stop after an attempt that ended as ``facts`` says; ``previous``: the
        attempt before it (None for the first)."""
        stop = Decision.STOP
        if facts.state not in RETRYABLE:
            return Verdict(stop, "not_retryable", f"the call ended {facts.state.value}")
        if restarts_so_far >= self.max_restarts:
            return Verdict(
                stop, "exhausted", f"max_restarts={self.max_restarts} restarts were used up"
            )
        if not facts.transient:
            assert facts.exc_type is not None
            name = facts.exc_type.rpartition(".")[2]
            said = unavailable_backend(facts.exc_type, facts.message)
            if said is not None:
                return Verdict(
                    stop,
                    "unavailable",
                    f"{facts.where} says {said!r}: the process group's backend is not "
                    "available in this torch or on this machine, so every attempt would fail "
                    'the same way (NCCL needs a CUDA build of torch and GPUs; on CPUs use "gloo")',
                )
            if name in NEVER_REPEATS:
                return Verdict(
                    stop,
                    "result",
                    "the function returned a value that cannot be pickled: every attempt "
                    "would return it again",
                )
            if (
                previous is not None
                and not previous.transient
                and facts.frame is not None
                and (previous.exc_type, previous.frame) == (facts.exc_type, facts.frame)
            ):
                return Verdict(
                    stop,
                    "repeated",
                    f"the same {facts.where} failed two attempts in a row: it is certain to repeat",
                )
            if not facts.progressed and name != "SystemExit":
                return Verdict(
                    stop,
                    "no_progress",
                    f"{facts.where} was raised before any rank reported a step or a restore: "
                    "it is certain to repeat (an exception is retried only once a rank has "
                    "reported progress: gangrun.report_step, or a checkpoint restore)",
                )
        wait = self.delay(restarts_so_far + 1)
        what = facts.exc_type or "an exit without a Python exception"
        if facts.state is State.HUNG:
            what = "a hang"
        return Verdict(
            Decision.RESTART,
            "restart",
            f"{what} is worth retrying; restart {restarts_so_far + 1}/{self.max_restarts} "
            f"in {wait:g}s",
            wait,
        )


__all__ = [
    "AttemptFacts",
    "Decision",
    "RestartPolicy",
    "PEER_ECHO_TEXT",
    "RETRYABLE",
    "TRANSIENT_TEXT",
    "TRANSIENT_TYPES",
    "UNAVAILABLE_TEXT",
    "Verdict",
    "any_of",
    "is_transient_exception",
    "unavailable_backend",
]
