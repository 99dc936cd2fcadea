"""What an observer of one call is told: a small immutable snapshot, filled by the lifecycle.

The lifecycle owns a `CallState` and tells it each transition (start, attempt,
rank exit, the last line a rank printed, the end); every change is pushed to the observers as
a `CallSnapshot` through ``on_start`` / ``on_update`` / ``on_end``. Observers must be
cheap in those methods (store and return): they are called from the caller's launch path,
the output pump and the monitor thread.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Protocol

from ..exitcodes import signal_name

log = logging.getLogger("gangrun.notebook")

STATES = ("starting", "running", "finished", "failed", "stopped")
MAX_LINE = 240


@dataclass(frozen=True)
class RankView:
    rank: int
    state: str = "starting"
    last_line: str = ""
    exitcode: int | None = None

    @property
    def signal(self) -> str | None:
        return signal_name(self.exitcode)


@dataclass(frozen=True)
class CallSnapshot:
    fn_name: str
    run_id: str
    world_size: int
    started_at: float  # time.time() of the submit
    attempt: int = 0
    max_restarts: int = 0
    ranks: tuple[RankView, ...] = ()
    mlflow_run_id: str | None = None
    tracking_uri: str | None = None
    experiment_id: str | None = None
    final: str | None = None  # FINISHED / FAILED / KILLED once the call ended
    message: str = ""  # one line: "starting 2 ranks…", the failure's first line
    ended_at: float | None = None
    resumed_from: int | None = None  # the step this attempt resumed at (a checkpoint restore)

    @property
    def elapsed(self) -> float:
        return (self.ended_at or time.time()) - self.started_at

    @property
    def run_url(self) -> str | None:
        """The MLflow UI address of the run when the tracking URI is a server."""
        uri = self.tracking_uri or ""
        if self.mlflow_run_id and uri.startswith(("http://", "https://")):
            exp = self.experiment_id or "0"
            return f"{uri.rstrip('/')}/#/experiments/{exp}/runs/{self.mlflow_run_id}"
        return None


class Observer(Protocol):
    def on_start(self, snapshot: CallSnapshot) -> None: ...
    def on_update(self, snapshot: CallSnapshot) -> None: ...
    def on_end(self, snapshot: CallSnapshot) -> None: ...


class CallState:
    """The mutable state of one call; every change reaches the observers as a snapshot."""

    def __init__(
        self, fn_name: str, run_id: str, max_restarts: int = 0, observers: Any = ()
    ) -> None:
        self._lock = threading.Lock()
        self._snap = CallSnapshot(fn_name, run_id, 0, time.time(), max_restarts=max_restarts)
        self.observers: list[Observer] = list(observers)
        self._started = False

    @property
    def snapshot(self) -> CallSnapshot:
        return self._snap

    def _set(self, event: str = "on_update", **changes: Any) -> None:
        with self._lock:
            if self._snap.final is not None and event != "on_end":
                return  # frozen: late lines of a teardown do not reopen the call
            self._snap = snap = replace(self._snap, **changes)
        for obs in self.observers:
            try:
                getattr(obs, event)(snap)
            except Exception:  # an observer's bug must never break the call
                log.exception("gangrun observer %r failed in %s", obs, event)

    def _rank(self, rank: int, **changes: Any) -> tuple[RankView, ...]:
        ranks = list(self._snap.ranks)
        if 0 <= rank < len(ranks):
            ranks[rank] = replace(ranks[rank], **changes)
        return tuple(ranks)

    # -- told by the lifecycle -------------------------------------------------------
    def starting(self, world_size: int, run_id: str = "") -> None:
        """Before anything slow (MLflow run creation, the fork server): 'starting N ranks…'."""
        self._started = True
        self._set(
            "on_start",
            run_id=run_id or self._snap.run_id,
            world_size=world_size,
            ranks=tuple(RankView(r) for r in range(world_size)),
            message=f"starting {world_size} rank{'s' if world_size != 1 else ''}…",
        )

    def tracking(self, run_id: str | None, uri: str | None, experiment_id: str | None) -> None:
        self._set(mlflow_run_id=run_id, tracking_uri=uri, experiment_id=experiment_id)

    def attempt_started(self, attempt: int) -> None:
        ranks = tuple(RankView(r, "running") for r in range(self._snap.world_size))
        self._set(attempt=attempt, ranks=ranks, message="running", resumed_from=None)

    def resumed(self, step: int) -> None:
        """The running attempt resumed from a checkpoint at ``step`` (its step reports)."""
        if self._snap.resumed_from != step:
            self._set(resumed_from=step)

    def rank_line(self, rank: int, text: str) -> None:
        text = text.strip()
        if text:
            self._set(ranks=self._rank(rank, last_line=text[:MAX_LINE]))

    def rank_exit(self, rank: int, exitcode: int, stopped: bool = False) -> None:
        state = "finished" if exitcode == 0 else ("stopped" if stopped else "failed")
        self._set(ranks=self._rank(rank, state=state, exitcode=exitcode))

    def ended(self, status: str, error: BaseException | None = None) -> None:
        """The call is over: ranks still running were stopped; the root cause failed."""
        if not self._started:
            return  # failed before it started (a launch error): no panel to freeze
        root = getattr(error, "rank", None)
        ranks = []
        for v in self._snap.ranks:
            if v.rank == root and v.state != "finished":
                v = replace(v, state="failed")
            elif v.state in ("starting", "running"):
                v = replace(v, state="finished" if status == "FINISHED" else "stopped")
            elif v.state == "failed" and root is not None and v.rank != root:
                v = replace(v, state="stopped")
            ranks.append(v)
        message = "finished" if status == "FINISHED" else status.lower()
        if error is not None:
            first = (str(error).strip().splitlines() or [type(error).__name__])[0]
            message = f"{type(error).__name__}: {first}"
        self._set("on_end", final=status, ranks=tuple(ranks), message=message, ended_at=time.time())


__all__ = ["CallSnapshot", "CallState", "Observer", "RankView", "STATES"]
