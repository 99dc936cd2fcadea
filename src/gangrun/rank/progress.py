"""Step reports: the rank tells the caller which step it is at (cheap enough for every step).

Rank side::

    for step in range(start, total):
        ...
        gangrun.report_step(step, total)     # progress, ETA, slow ranks; counts for the hang guard

The checkpoint manager calls `report_resumed` after a restore that loaded a checkpoint, so
the caller knows an attempt made progress and from which step it resumed, and
`report_fresh_start` after one that found none (the rank is at step 0: shown, but not
progress; the restart rules, docs/restarts.md, retry an exception only after progress).
Each report says whether the rank has made progress in this attempt (`StepReport.progressed`:
a reported step or a loaded checkpoint).

Each rank owns one small fixed-size file, ``progress.<rank>`` in the run directory
(`gangrun.wire.rundir.RunDir.progress`), overwritten in place with ``pwrite`` (no rename, no
fsync): a report is a clock read and, at most every `MIN_INTERVAL_S` (and always for the
first report and a changed total), one 96-byte write of a `gangrun.wire.progress.StepReport`;
the report the throttle held back last is written when the rank ends (`flush`, called by
`gangrun.rank.worker`). The caller reads it with `gangrun.wire.progress.read` (a torn or
garbled read is ``None``, never an exception). Outside a rank (nothing
bound), in a forked child of a rank (a DataLoader worker), or once the run
directory is gone, a report is a no-op.
"""

from __future__ import annotations

import os
import time

from ..wire import progress as progress_file
from ..wire.progress import StepReport

MIN_INTERVAL_S = 0.1

_fd: int | None = None
_pid = 0
_rank = -1  # the bound rank
_last_write = 0.0
_first: tuple[int, float] | None = None  # (step, wall time) of this process's first report
_resumed = -1
_saved_world = -1  # the world size that saved the restored checkpoint (-1: not said)
_total = -1
_step = -1
_progressed = False  # a step reported, or a checkpoint loaded, in this attempt
_disabled = False
_bound: tuple[str, int, int] | None = None
_written: tuple[int, int, int, bool] = (-1, -1, -1, False)  # (step, total, resumed, progressed)


def bind(run_dir: str, rank: int) -> None:
    """In a rank (called by `gangrun.rank.worker` at start): reports go to this run
    directory. Only the process that bound reports; its forks (DataLoader workers) do not."""
    global _bound, _fd, _pid, _disabled, _first, _last_write, _resumed, _total, _step, _written
    global _progressed, _saved_world, _rank
    _bound = (run_dir, int(rank), os.getpid())
    _rank = int(rank)
    _written = (-1, -1, -1, False)
    _fd = None
    _pid = 0
    _disabled = False
    _first = None
    _last_write = 0.0
    _resumed = _total = _step = _saved_world = -1
    _progressed = False


def _open() -> int | None:
    global _fd, _pid, _disabled
    if _fd is not None:
        if _pid == os.getpid():
            return _fd
        _fd = None  # a fork of the rank: not ours to write
        _disabled = True
        return None
    if _disabled or _bound is None or _bound[2] != os.getpid():
        return None
    run_dir, rank, pid = _bound
    try:
        _fd = progress_file.open_for_writing(run_dir, rank)
    except OSError:
        _disabled = True
        return None
    _pid = pid
    return _fd


def _write(fd: int, now: float) -> None:
    global _last_write, _fd, _disabled, _written
    assert _first is not None
    report = StepReport(
        rank=_rank,
        step=_step,
        total=None if _total < 0 else _total,
        resumed_from=None if _resumed < 0 else _resumed,
        first_step=_first[0],
        first_time=_first[1],
        time=now,
        progressed=_progressed,
        saved_world=None if _saved_world < 0 else _saved_world,
    )
    try:
        progress_file.write(fd, report)
    except OSError:  # run directory gone or disk full: reports are best effort
        os.close(fd)
        _fd = None
        _disabled = True
        return
    _last_write = time.monotonic()
    _written = (_step, _total, _resumed, _progressed)


def report_step(step: int, total: int | None = None) -> None:
    """Report that this rank is at ``step`` (of ``total`` when known). Cheap: call it every
    step. A no-op outside a gangrun rank. A reported step is progress (docs/restarts.md)."""
    global _first, _total, _step, _progressed
    fd = _open()
    if fd is None:
        return
    step = int(step)
    new_total = -1 if total is None else int(total)
    _step = step
    now = time.time()
    first_progress, _progressed = not _progressed, True
    if _first is None:
        _first = (step, now)
    elif (
        not first_progress
        and new_total == _total
        and time.monotonic() - _last_write < MIN_INTERVAL_S
    ):
        return
    _total = new_total
    _write(fd, now)


def flush() -> None:
    """Write the last report if the throttle held it back (the rank calls it as it ends, so
    the caller sees the final step)."""
    fd = _fd
    if fd is None or _first is None or _pid != os.getpid():
        return
    if _written != (_step, _total, _resumed, _progressed):
        _write(fd, time.time())


def report_fresh_start() -> None:
    """Record that this attempt starts at step 0 with nothing restored (the checkpoint manager
    calls it after a restore that found no checkpoint). Not progress: an exception raised
    before a step is reported is not retried (docs/restarts.md)."""
    global _first, _step
    fd = _open()
    if fd is None or _first is not None:
        return  # something was reported already: keep it
    _step = 0
    _first = (0, time.time())
    _write(fd, _first[1])


def report_resumed(step: int, saved_world: int | None = None) -> None:
    """Record that this attempt resumed from a checkpoint at ``step`` (the checkpoint manager
    calls it after a restore that loaded one; the next step reported is usually ``step``),
    saved by ``saved_world`` ranks (said when another number than this attempt's).
    Progress, as a reported step is."""
    global _resumed, _first, _step, _progressed, _saved_world
    fd = _open()
    if fd is None:
        return
    _resumed = int(step)
    _saved_world = -1 if saved_world is None else int(saved_world)
    _progressed = True
    now = time.time()
    if _first is None or _step < 0:
        _step = int(step)
        _first = (int(step), now)
    _write(fd, now)


__all__ = [
    "report_step",
    "report_resumed",
    "report_fresh_start",
    "flush",
    "MIN_INTERVAL_S",
]
