"""The wait of one attempt: the gang's events until every rank ended, one failed, the
deadline passed, a hang was found or the call was cancelled (torch elastic's
``_monitor_workers``, Ray Train's ``WorkerGroup.poll_status``). The supervisor owns what the
attempt acquired and its teardown; this module only reads events and decides the ending."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from typing import Any

from ..launch import RankExit
from .seams import QueueItem
from .state import (
    CancelRequested,
    DeadlineReached,
    Event,
    HangDetected,
    PreemptRequested,
    RankExited,
)


def next_event(events: queue.Queue[QueueItem], wait: float | None) -> Event | None:
    """The next event (a rank's exit as `RankExited`), or ``None`` after ``wait`` seconds."""
    try:
        item = events.get(timeout=wait)
    except queue.Empty:
        return None
    return RankExited(item) if isinstance(item, RankExit) else item


def wait_attempt(
    events: queue.Queue[QueueItem],
    remaining: set[int],
    exits: dict[int, RankExit],
    deadline: float | None,
    timeout: float | None,
    guard: Any,
    pids: Callable[[], dict[int, int]],
    cancelled: Callable[[], str | None],
    on_exit: Callable[[int, int, bool], None],
    exit_failed: Callable[[RankExit], bool],
) -> Event | None:
    """Wait until the attempt ends; the event that ended it (``None``: every rank ended on its
    own and none failed). ``remaining`` and ``exits`` are kept up to date as ranks end (the
    supervisor's teardown reads them, also when this raises)."""
    watching = guard is not None and guard.on
    while remaining:
        reason = cancelled()
        if reason is not None:
            return CancelRequested(reason)
        wait = None if deadline is None else deadline - time.monotonic()
        if wait is not None and wait <= 0:
            if guard is not None:  # where each rank was: the timeout's explanation
                guard.explain(pids(), sorted(remaining))
            return DeadlineReached(float(timeout or 0))
        if watching:
            wait = guard.poll_interval if wait is None else min(wait, guard.poll_interval)
        ev = next_event(events, wait)
        if ev is None:
            holders = guard.check(sorted(remaining), pids()) if watching else []
            if holders:
                guard.dump_stacks(pids(), sorted(remaining))
                return HangDetected(holders)
            continue
        if isinstance(ev, PreemptRequested):
            continue  # the ranks save and stop (rank/stop.py); for a back-off only
        if not isinstance(ev, RankExited):
            return ev
        exits[ev.rank] = ev.exit
        on_exit(ev.rank, ev.exit.exitcode, False)
        remaining.discard(ev.rank)
        if exit_failed(ev.exit):
            return ev
    return None


def late_exits(
    events: queue.Queue[QueueItem],
    exits: dict[int, RankExit],
    on_exit: Callable[[int, int, bool], None],
) -> None:
    """Add the exits that arrived during the teardown (ranks the teardown stopped)."""
    while True:
        late = next_event(events, 0)
        if late is None:
            return
        if isinstance(late, RankExited) and late.rank not in exits:
            exits[late.rank] = late.exit
            on_exit(late.rank, late.exit.exitcode, True)


__all__ = ["late_exits", "next_event", "wait_attempt"]
