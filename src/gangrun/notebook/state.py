"""What the notebook panel shows of one call: a small immutable snapshot, and its reducer.

The panel (`gangrun.notebook.panel`, an observer of the call's lifecycle) owns a `CallState`
and tells it what happened (start, attempt, rank exit, the last line a rank printed, the
end); each change becomes a new `CallSnapshot`, handed to the one ``on_change`` callback
given at construction. The snapshot reads the call's identity (run id, function, world
size) from the call's own record (`CallIdentity`: ``gangrun.lifecycle.record.CallRecord``),
never a copy of it.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

from ..errors import DistributedError
from ..wire.exitcodes import signal_name
from ..wire.security import redact

log = logging.getLogger("gangrun.notebook")

MAX_LINE = 240


class RankState(str, enum.Enum):
    """What a rank's row shows (the HTML's ``data-state``)."""

    STARTING = "starting"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"
    STOPPED = "stopped"

    __str__ = str.__str__  # f-strings and escape() give the value

    def __format__(self, spec: str) -> str:
        return str.__format__(self.value, spec)


STATES = tuple(s.value for s in RankState)


class CallIdentity(Protocol):
    """Who the call is (``gangrun.lifecycle.record.CallRecord`` is one)."""

    @property
    def run_id(self) -> str: ...
    @property
    def fn_name(self) -> str: ...
    @property
    def world_size(self) -> int: ...
    @property
    def max_restarts(self) -> int: ...


@dataclass(frozen=True)
class RankView:
    rank: int
    state: RankState = RankState.STARTING
    last_line: str = ""
    exitcode: int | None = None

    @property
    def signal(self) -> str | None:
        return signal_name(self.exitcode)


@dataclass(frozen=True)
class CallSnapshot:
    call: CallIdentity
    started_at: float  # time.time() of the submit
    attempt: int = 0
    ranks: tuple[RankView, ...] = ()
    mlflow_run_id: str | None = None
    tracking_uri: str | None = None
    experiment_id: str | None = None
    final: str | None = None  # FINISHED / FAILED / KILLED once the call ended
    message: str = ""  # one line: "starting 2 ranks…", the failure's first line
    ended_at: float | None = None

    @property
    def fn_name(self) -> str:
        return self.call.fn_name

    @property
    def run_id(self) -> str:
        return self.call.run_id

    @property
    def world_size(self) -> int:
        return self.call.world_size

    @property
    def max_restarts(self) -> int:
        return self.call.max_restarts

    @property
    def elapsed(self) -> float:
        return (self.ended_at or time.time()) - self.started_at

    @property
    def run_url(self) -> str | None:
        """The MLflow UI address of the run when the tracking URI is a server."""
        uri = self.tracking_uri or ""
        if self.mlflow_run_id and uri.startswith(("http://", "https://")):
            exp = self.experiment_id or "0"
            return f"{redact(uri).rstrip('/')}/#/experiments/{exp}/runs/{self.mlflow_run_id}"
        return None


class CallState:
    """The changing state of one call's panel; every change is handed to ``on_change`` as a
    new snapshot (the last one has ``final`` set; nothing changes after it)."""

    def __init__(
        self, call: CallIdentity, on_change: Callable[[CallSnapshot], None] | None = None
    ) -> None:
        self._lock = threading.Lock()
        self._snap = CallSnapshot(call, time.time())
        self._on_change = on_change
        self._started = False

    @property
    def snapshot(self) -> CallSnapshot:
        return self._snap

    def _set(self, **changes: Any) -> None:
        with self._lock:
            if self._snap.final is not None:
                return  # frozen: late lines of a teardown do not reopen the call
            self._snap = snap = replace(self._snap, **changes)
        if self._on_change is not None:
            try:
                self._on_change(snap)
            except Exception:  # the panel's bug must never break the call
                log.exception("gangrun panel failed on a change of %s", snap.run_id)

    def _rank(self, rank: int, **changes: Any) -> tuple[RankView, ...]:
        ranks = list(self._snap.ranks)
        if 0 <= rank < len(ranks):
            ranks[rank] = replace(ranks[rank], **changes)
        return tuple(ranks)

    # -- told by the lifecycle -------------------------------------------------------
    def starting(self) -> None:
        """Before anything slow (MLflow run creation, the fork server): 'starting N ranks…'."""
        self._started = True
        n = self._snap.world_size
        self._set(
            ranks=tuple(RankView(r) for r in range(n)),
            message=f"starting {n} rank{'s' if n != 1 else ''}…",
        )

    def tracking(self, run_id: str | None, uri: str | None, experiment_id: str | None) -> None:
        self._set(mlflow_run_id=run_id, tracking_uri=uri, experiment_id=experiment_id)

    def attempt_started(self, attempt: int) -> None:
        ranks = tuple(RankView(r, RankState.RUNNING) for r in range(self._snap.world_size))
        self._set(attempt=attempt, ranks=ranks, message="running")

    def rank_line(self, rank: int, text: str) -> None:
        text = text.strip()
        if text:
            self._set(ranks=self._rank(rank, last_line=text[:MAX_LINE]))

    def rank_exit(self, rank: int, exitcode: int, stopped: bool = False) -> None:
        state = RankState.FINISHED if exitcode == 0 else RankState.FAILED
        if exitcode != 0 and stopped:
            state = RankState.STOPPED
        self._set(ranks=self._rank(rank, state=state, exitcode=exitcode))

    def ended(self, status: str, error: BaseException | None = None) -> None:
        """The call is over: ranks still running were stopped; the root cause failed."""
        if not self._started:
            return  # failed before it started (a launch error): no panel to freeze
        root = error.rank if isinstance(error, DistributedError) else None
        ranks = []
        ended = RankState.FINISHED if status == "FINISHED" else RankState.STOPPED
        for v in self._snap.ranks:
            if v.rank == root and v.state is not RankState.FINISHED:
                v = replace(v, state=RankState.FAILED)
            elif v.state in (RankState.STARTING, RankState.RUNNING):
                v = replace(v, state=ended)
            elif v.state is RankState.FAILED and root is not None and v.rank != root:
                v = replace(v, state=RankState.STOPPED)
            ranks.append(v)
        message = "finished" if status == "FINISHED" else status.lower()
        if error is not None:
            first = (str(error).strip().splitlines() or [type(error).__name__])[0]
            message = f"{type(error).__name__}: {first}"
        self._set(final=status, ranks=tuple(ranks), message=message, ended_at=time.time())


__all__ = ["CallIdentity", "CallSnapshot", "CallState", "RankState", "RankView", "STATES"]
