"""``progress.<rank>``: a rank's last step report (`StepReport`), one fixed-size line the rank
overwrites in place (`gangrun.rank.progress` decides when) and the caller reads (`read`).

The line is ``step total resumed first_step first_time time progressed saved_world``
(``-1``: not said), padded to `SIZE` bytes. `read` takes a line of an earlier version (without
the last two fields: progressed, whole world) and returns ``None`` for a torn or garbled one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .rundir import RunDir

SIZE = 96


@dataclass(frozen=True)
class StepReport:
    """What one rank last reported (caller side)."""

    rank: int
    step: int
    total: int | None  # None: the rank did not say
    resumed_from: int | None  # the step a checkpoint restore resumed at (None: fresh start)
    first_step: int  # first reported step of this attempt, and when (wall clock)
    first_time: float
    time: float  # wall clock of the last write
    progressed: bool = True  # a step reported or a checkpoint loaded (not a fresh start alone)
    saved_world: int | None = None  # ranks that saved the restored checkpoint, when said

    @property
    def rate(self) -> float | None:
        """Steps per second since the first report of this attempt (None: too early)."""
        dt = self.time - self.first_time
        if dt <= 0 or self.step <= self.first_step:
            return None
        return (self.step - self.first_step) / dt

    def to_bytes(self) -> bytes:
        """The report as the file holds it: `SIZE` bytes."""
        line = (
            f"{self.step} {-1 if self.total is None else self.total} "
            f"{-1 if self.resumed_from is None else self.resumed_from} {self.first_step} "
            f"{self.first_time:.6f} {self.time:.6f} {int(self.progressed)} "
            f"{-1 if self.saved_world is None else self.saved_world}"
        )
        return line.ljust(SIZE - 1).encode() + b"\n"


def open_for_writing(run_dir: str, rank: int) -> int:
    """The rank's file, opened once (0600) for every `write`. Raises ``OSError``."""
    return os.open(RunDir(run_dir).progress(rank), os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)


def write(fd: int, report: StepReport) -> None:
    """Overwrite the report in place: no rename, no fsync (a torn read is None). Raises
    ``OSError``."""
    os.pwrite(fd, report.to_bytes(), 0)


def read(run_dir: str, rank: int) -> StepReport | None:
    """Caller side: rank ``rank``'s last report, or None (nothing reported, or a torn read)."""
    try:
        with open(RunDir(run_dir).progress(rank), "rb") as f:
            raw = f.read(SIZE)
        step, total, resumed, first_step, first_time, t, *more = raw.decode().split()
        if len(more) > 2:
            return None
        return StepReport(
            rank=rank,
            step=int(step),
            total=None if int(total) < 0 else int(total),
            resumed_from=None if int(resumed) < 0 else int(resumed),
            first_step=int(first_step),
            first_time=float(first_time),
            time=float(t),
            progressed=more[:1] != ["0"],
            saved_world=int(more[1]) if len(more) > 1 and int(more[1]) > 0 else None,
        )
    except (OSError, ValueError, UnicodeDecodeError):
        return None


def read_all(run_dir: str, world_size: int) -> dict[int, StepReport]:
    """Every rank's last report (ranks that reported nothing are absent)."""
    out = {}
    for r in range(world_size):
        rep = read(run_dir, r)
        if rep is not None:
            out[r] = rep
    return out


__all__ = ["SIZE", "StepReport", "open_for_writing", "read", "read_all", "write"]
