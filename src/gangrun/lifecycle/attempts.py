"""Between two attempts of a call: what the ended attempt did, whether to restart, the back-off.

The supervisor hands each ended `Attempt` to
`Restarts.after` *before* the run directory's per-attempt files are cleared: it reads
the ranks' step reports (`gangrun.rank.progress`), turns the root cause into
`AttemptFacts`, asks the `RestartPolicy` and writes
the verdict onto the attempt (which observers see: the notice, the MLflow run's
``gangrun_attempts.json``, the panel). `Restarts.back_off` waits before a restart on the
call's own event queue, so a cancel (``handle.cancel()``, a ``KeyboardInterrupt``, the
caller's exit) ends the wait at once, and the call's deadline ends it too; so does a
preemption (``cancel(checkpoint=True)``, SIGTERM to the caller), with the
`DistributedPreemptedError` of the last complete checkpoint (no rank runs to save one).
"""

from __future__ import annotations

import json
import queue
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from .._log import get_logger
from ..errors import DistributedCancelledError, DistributedError, DistributedTimeoutError
from ..options import Options
from ..wire import progress
from ..wire.tags import TAG_ATTEMPTS, TAG_RESTART_STOP
from .policy import AttemptFacts, Decision, RestartPolicy, Verdict
from .state import Attempt, CancelRequested, State

if TYPE_CHECKING:
    from ..tracking.caller import Tracker
    from .seams import QueueItem

# get_logger applies GANGRUN_LOG_LEVEL (DEBUG/INFO: each decision, the back-off, on stderr)
log = get_logger("gangrun.lifecycle.restarts")

ARTIFACT = "gangrun_attempts.json"
_MAX_MESSAGE = 1000


class CallInfo(Protocol):
    """What `Restarts` reads of the call (its supervisor)."""

    @property
    def run_id(self) -> str: ...
    @property
    def fn_name(self) -> str: ...
    @property
    def attempt(self) -> int: ...  # 0: the first attempt
    @property
    def mlflow_run_id(self) -> str | None: ...

    ckpt_env: dict[str, str]  # the ranks' checkpoint environment (empty: no checkpoints)


def facts_of(attempt: Attempt, reports: dict[int, progress.StepReport]) -> AttemptFacts:
    """The policy's view of an ended attempt: its root cause and whether any rank progressed."""
    # a reported step or a loaded checkpoint; a fresh start's report (nothing restored) is not
    progressed = any(r.progressed for r in reports.values())
    err = attempt.error
    if attempt.state is not State.FAILED or not isinstance(err, DistributedError):
        return AttemptFacts(attempt.state, progressed=progressed)
    failure = err.failures.get(err.rank) if err.rank is not None else None
    if failure is None or failure.exc_type is None:
        return AttemptFacts(State.FAILED, progressed=progressed)  # a signal, an exit status
    return AttemptFacts(
        State.FAILED,
        exc_type=failure.exc_type,
        message=failure.message,
        frame=failure.frame,
        progressed=progressed,
    )


class Restarts:
    """The restart bookkeeping of one call (owned by its supervisor's monitor thread)."""

    def __init__(self, options: Options, call: CallInfo) -> None:
        self.policy = RestartPolicy.of(options)
        self.timeout = options.timeout  # the call's: a back-off counts within it
        self.call = call  # its run id, function name and attempt number (0: the first)
        self._previous: AttemptFacts | None = None
        self._last_error: BaseException | None = None  # the failure a back-off follows
        self._launched = 0.0

    def launched(self) -> None:
        """An attempt was just launched (its start time goes on its record)."""
        self._launched = time.time()

    def after(self, attempt: Attempt, run_dir: str, world_size: int) -> Verdict:
        """Judge the ended ``attempt`` and record the verdict and the ranks' progress on it."""
        restarts = self.call.attempt  # restarts made so far
        reports = progress.read_all(run_dir, world_size)
        resumed = [r.resumed_from for r in reports.values() if r.resumed_from is not None]
        attempt.started, attempt.ended = self._launched, time.time()
        attempt.world_size = world_size
        attempt.resumed_from = min(resumed) if resumed else None
        attempt.last_step = max((r.step for r in reports.values()), default=None)
        facts = facts_of(attempt, reports)
        verdict = self.policy.judge(facts, self._previous, restarts)
        self._previous, self._last_error = facts, attempt.error
        attempt.decision, attempt.reason = verdict.decision, verdict.reason
        attempt.backoff = verdict.backoff if verdict.decision is Decision.RESTART else 0.0
        log.info(
            "call %s: attempt %d ended %s (%s; progress: %s): %s, %s",
            self.call.run_id,
            attempt.number + 1,
            attempt.state.value,
            facts.where if facts.exc_type else "no exception",
            "yes" if facts.progressed else "none reported",
            verdict.decision.value,
            verdict.reason,
        )
        return verdict

    def back_off(
        self,
        seconds: float,
        events: queue.Queue[QueueItem] | None,
        started: float,
        cancelled: Callable[[], str | None],
        preempted: Callable[[], bool] = lambda: False,
    ) -> Attempt | None:
        """Wait ``seconds`` before the next restart, on the call's event queue (``started``:
        the call's start, ``time.monotonic()``: the wait counts within its timeout). Returns
        ``None`` to go on, or the ended attempt (CANCELLED / TIMED_OUT) when a cancel, a
        preemption (``preempted()`` true: its `PreemptRequested` event wakes the wait) or the
        call's deadline came first."""
        number = self.call.attempt + 1
        timeout = self.timeout
        deadline = None if timeout is None else started + timeout
        end = time.monotonic() + max(0.0, seconds)
        log.debug("call %s: waiting %.3gs before restart %d", self.call.run_id, seconds, number)
        while True:
            reason = cancelled()
            if reason is not None:
                return self._ended_waiting(State.CANCELLED, reason, number)
            if preempted() and self.call.ckpt_env:
                return self._ended_waiting(State.CANCELLED, "preempted", number, preempt=True)
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return self._ended_waiting(State.TIMED_OUT, f"{timeout or 0:g}", number)
            if now >= end:
                return None
            wait = (end if deadline is None else min(end, deadline)) - now
            if events is None:
                time.sleep(wait)
                continue
            try:
                item = events.get(timeout=wait)
            except queue.Empty:
                continue
            if isinstance(item, CancelRequested):
                return self._ended_waiting(State.CANCELLED, item.reason, number)
            # a PreemptRequested: the loop's check ends the wait; anything else (a late rank
            # exit of the ended attempt) is ignored

    def _ended_waiting(
        self, state: State, what: str, number: int, preempt: bool = False
    ) -> Attempt:
        name, where = self.call.fn_name, f"while waiting to restart (restart {number})"
        log.info("call %s: %s %s", self.call.run_id, state.value, where)
        prev = self._last_error
        after = (str(prev).strip().splitlines() or [""])[0] if prev is not None else ""
        after = f" The attempt before failed: {after}" if after else ""
        if preempt:
            from .checkpoints import preempted_waiting

            call = self.call
            err: DistributedError = preempted_waiting(
                call.ckpt_env, name, call.run_id, call.mlflow_run_id, where, after
            )
        elif state is State.CANCELLED:
            err = DistributedCancelledError(
                f"{name} was {what} {where}; no rank was running.{after}",
                run_id=self.call.run_id,
            )
        else:
            err = DistributedTimeoutError(
                f"{name} did not finish within timeout={what}s (it ran out {where}); no rank "
                f"was running.{after}",
                run_id=self.call.run_id,
            )
        err.__cause__ = prev  # what the restart was for
        return Attempt(number, state, err, started=time.time(), ended=time.time())


def annotate(error: BaseException | None, attempts: list[Attempt], max_restarts: int) -> None:
    """Append to the call's final error how many attempts ran and why restarts stopped."""
    if not isinstance(error, DistributedError) or max_restarts <= 0 or not attempts:
        return
    last = attempts[-1]
    n = len(attempts)
    ran = f"{n} attempt{'s' if n != 1 else ''} ran (max_restarts={max_restarts})"
    judged = last.decision is Decision.STOP and last.state in (State.FAILED, State.HUNG)
    why = f"; restarts stopped: {last.reason}" if judged and last.reason else ""
    note = f"\n\n{ran}{why}."
    text = str(error)
    if note.strip() not in text:
        error.args = (text + note, *error.args[1:])


def attempts_json(attempts: list[Attempt]) -> str:
    """The attempts of a call as the MLflow artifact ``gangrun_attempts.json`` holds them."""
    out = []
    for a in attempts:
        err = a.error
        failure: dict[str, Any] | None = None
        if err is not None:
            dist = err if isinstance(err, DistributedError) else None
            rank = dist.rank if dist is not None else None
            f = dist.failures.get(rank) if dist is not None and rank is not None else None
            first = (str(err).strip().splitlines() or [""])[0]
            failure = {
                "rank": rank,
                "type": f.exc_type if f is not None and f.exc_type else type(err).__name__,
                "message": (f.message if f is not None else first)[:_MAX_MESSAGE],
                "signal": f.signal if f is not None else None,
                "exitcode": f.exitcode if f is not None else dist.exitcode if dist else None,
                "frame": f.frame if f is not None else None,
                "time": f.time if f is not None and f.time else a.ended,
            }
        out.append(
            {
                "attempt": a.number + 1,
                "state": a.state.value,
                "started": a.started,
                "ended": a.ended,
                "resumed_from": a.resumed_from,
                "last_step": a.last_step,
                "world_size": a.world_size,
                "failure": failure,
                "decision": a.decision.value if a.decision is not None else "",
                "reason": a.reason,
                "backoff_s": a.backoff,
            }
        )
    return json.dumps({"attempts": out}, indent=1)


def record_mlflow(tracker: Tracker | None, attempts: list[Attempt], final: bool) -> None:
    """Tag the run with the number of attempts and attach ``gangrun_attempts.json`` (on each
    restart and at the end: one run holds every attempt). Raises what MLflow raises."""
    if tracker is None or not attempts:
        return
    client, run_id = tracker.client, tracker.run_id
    client.set_tag(run_id, TAG_ATTEMPTS, str(len(attempts)))
    last = attempts[-1]
    resume = tracker.resume_number
    if final and last.decision is Decision.STOP and last.state in (State.FAILED, State.HUNG):
        client.set_tag(run_id, TAG_RESTART_STOP, last.reason[:5000])
    elif final and resume and TAG_RESTART_STOP in client.get_run(run_id).data.tags:
        client.delete_tag(run_id, TAG_RESTART_STOP)  # an earlier call's: no longer the story
    name = ARTIFACT if not resume else f"resume{resume}/{ARTIFACT}"
    client.log_text(run_id, attempts_json(attempts), name)


__all__ = [
    "ARTIFACT",
    "Restarts",
    "TAG_ATTEMPTS",
    "TAG_RESTART_STOP",
    "annotate",
    "attempts_json",
    "facts_of",
    "record_mlflow",
]
