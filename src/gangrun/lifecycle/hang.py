"""The stuck-rank guard (opt-in ``hang_timeout=SECONDS``).

A rank whose process is alive but makes no progress (typically blocked in a collective that a
peer never joins) hangs a job until the call's ``timeout``. With ``hang_timeout`` set, each rank
counts as making progress when it

- writes output (any stdout/stderr bytes: the caller's output pump appends them to the rank's
  log file, whose modification time is the beat), or
- calls [`gangrun.heartbeat`][gangrun.rank.heartbeat.heartbeat] (touches ``heartbeat.<rank>`` in the private run directory;
  call it once per training step when a step prints nothing).

When a live rank has made no progress for ``hang_timeout`` seconds, the caller sends ``SIGUSR1``
to every live rank (each registered ``faulthandler`` for it, writing all threads' Python stacks
to ``stacks.<rank>`` in the run directory), waits briefly for the dumps, stops the gang and
raises [`gangrun.DistributedHangError`][gangrun.errors.DistributedHangError] naming the silent ranks, with every rank's stack.
Like any failure, a hang is retried when ``max_restarts`` allows.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

from ..rank import stacks
from ..wire import heartbeat as beat_file
from ..wire.rundir import RunDir, log_path

if TYPE_CHECKING:
    from ..errors import DistributedHangError


def last_progress(run_dir: str, log_dir: str, rank: int, since: float) -> float:
    """When rank ``rank`` last made progress (output, heartbeat, step report), at the
    earliest ``since`` (wall clock)."""
    t = since
    beat = beat_file.read(run_dir, rank)
    if beat is not None:
        t = max(t, beat.time)
    for p in (log_path(log_dir, rank), RunDir(run_dir).progress(rank)):  # output, report_step
        try:
            t = max(t, os.stat(p).st_mtime)
        except OSError:  # not written yet: no progress from it
            pass
    return t


class HangGuard:
    """Watches one attempt's ranks for progress."""

    def __init__(self, run_dir: str, log_dir: str, world_size: int, hang_timeout: float) -> None:
        self.run_dir = run_dir
        self.log_dir = log_dir
        self.world_size = world_size
        self.hang_timeout = float(hang_timeout)
        self.started = time.time()
        self.stalled: list[int] = []
        self.idle: dict[int, float] = {}
        self.stacks: dict[int, str] = {}
        # No clean-up of heartbeat/stack files here: the ranks may already have created them
        # (a forked rank boots in milliseconds). The run clears them before each new attempt.

    @property
    def poll_interval(self) -> float:
        return min(1.0, max(0.05, self.hang_timeout / 5))

    def last_progress(self, rank: int) -> float:
        return last_progress(self.run_dir, self.log_dir, rank, self.started)

    def booted(self, rank: int) -> bool:
        """The rank installed the guard (heartbeat file, SIGUSR1 stack dump). A rank still
        starting its interpreter is left to the call's ``timeout``: SIGUSR1 would kill it."""
        return beat_file.read(self.run_dir, rank) is not None

    def check(self, live_ranks: list[int]) -> list[int]:
        """The live ranks silent for longer than ``hang_timeout`` (empty: all fine)."""
        now = time.time()
        idle = {r: now - self.last_progress(r) for r in live_ranks if self.booted(r)}
        stalled = sorted(r for r, s in idle.items() if s > self.hang_timeout)
        if stalled:
            self.stalled = stalled
            self.idle = idle
        return stalled

    def dump_stacks(self, pids: dict[int, int], live_ranks: list[int], wait: float = 2.0) -> None:
        """SIGUSR1 every live rank and collect what faulthandler wrote."""
        live = {r: pids[r] for r in live_ranks if r in pids and self.booted(r)}
        self.stacks.update(stacks.request(self.run_dir, live, wait))
        for r in live:
            self.stacks.setdefault(r, "")

    def error(self, fn_name: str, run_id: str, log_dir: str) -> DistributedHangError:
        from ..errors import DistributedHangError

        parts = []
        for r in sorted(self.stacks):
            state = (
                f"silent for {self.idle.get(r, 0):.0f}s"
                if r in self.stalled
                else "still making progress"
            )
            stack = self.stacks[r] or "(no stack dump: the rank did not answer SIGUSR1)"
            parts.append(f"--- rank {r} ({state}) ---\n{stack}")
        ranks = ", ".join(map(str, self.stalled))
        msg = (
            f"{fn_name}: rank(s) {ranks} made no progress (no output, no gangrun.heartbeat()) "
            f"for hang_timeout={self.hang_timeout:g}s; all {self.world_size} ranks were stopped. "
            "Python stacks of the live ranks at that moment:\n\n"
            + "\n\n".join(parts)
            + f"\n\nFull logs: err.logs(rank), or the files in {log_dir}"
        )
        return DistributedHangError(
            msg,
            rank=self.stalled[0] if self.stalled else None,
            run_id=run_id,
            ranks=list(self.stalled),
            stacks=dict(self.stacks),
        )


__all__ = ["last_progress", "HangGuard"]
