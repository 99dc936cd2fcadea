"""The hang verdict's caller half: watch the ranks, decide, explain.

Every ``poll_interval`` the guard reads each rank's ring of ``torch.distributed`` calls
(`gangrun.wire.collectives`, written by `gangrun.rank.collectives`) and samples its progress:
CPU time of the rank's process tree (its DataLoader workers and subprocesses included), I/O
bytes of that tree, output (its log file), `gangrun.heartbeat` and `gangrun.report_step`, and
its ring moving. A stopped process (SIGSTOP) never counts as progress. `gangrun.lifecycle.verdict`
judges: some rank has waited ``T`` seconds in a collective while a rank it needs has not
entered it and shows no progress for ``T``, or entered a different or mismatched one. Then
the guard dumps the ranks' stacks (``SIGUSR1``; a DataLoader's workers too when the rank waits
on them; never a stopped rank), the gang is stopped and the call raises
[`DistributedHangError`][gangrun.errors.DistributedHangError] naming the holding rank(s).

``T`` is ``hang_timeout``: a number of seconds, or ``"auto"``: max(10 s, 3x the p99 step time
seen so far from the ranks' step reports). The same reading explains a call that ran out of
its ``timeout`` (`explain`), also with the verdict off.
"""

from __future__ import annotations

import os
import signal
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from ..rank import stacks
from ..wire import collectives as ring_file
from ..wire import flight as flight_file
from ..wire import heartbeat as beat_file
from ..wire import memory as memory_file
from ..wire import progress as progress_file
from ..wire import stacks as stack_file
from ..wire.collectives import RingView
from ..wire.flight import FlightDump
from ..wire.hangs import Hang, RankPlace
from ..wire.rundir import RunDir, log_path
from . import verdict

if TYPE_CHECKING:
    from ..errors import DistributedHangError

AUTO_MIN_S = 10.0
_CPU_SHARE = 0.05  # CPU time rising by more than this share of the wall time is progress
_TICK_S = 0.011


def _catches_usr1(pid: int) -> bool:
    """The process handles SIGUSR1 (a forked DataLoader worker inherits faulthandler's)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signal.SIGUSR1 - 1) & 1)
    except (OSError, ValueError):
        pass
    return False


def last_progress(run_dir: str, log_dir: str, rank: int, since: float) -> float:
    """When rank ``rank`` last wrote output, beat or reported a step, at the earliest
    ``since`` (wall clock): the panel's "quiet for" mark."""
    t = since
    beat = beat_file.read(run_dir, rank)
    if beat is not None:
        t = max(t, beat.time)
    for p in (log_path(log_dir, rank), RunDir(run_dir).progress(rank)):
        try:
            t = max(t, os.stat(p).st_mtime)
        except OSError:  # not written yet: no progress from it
            pass
    return t


class _Sampler:
    """One rank's progress indicators between two samples."""

    def __init__(self, now: float) -> None:
        self.progress_at = now
        self.cpu: float | None = None
        self.io = 0
        self.cpu_at = now
        self.marks: tuple[Any, ...] = ()
        self.proc: Any = None
        self.stopped = False

    def tree(
        self, pid: int, kids: dict[int, list[int]], quiet_tid: int | None = None
    ) -> tuple[float, int, bool] | None:
        """(CPU seconds, I/O bytes, stopped) of the process and its descendants (``kids``:
        parent pid -> child pids, read once per sample for every rank)."""
        import psutil

        try:
            if self.proc is None or self.proc.pid != pid:
                self.proc = psutil.Process(pid)
            stopped = self.proc.status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
        except (psutil.Error, OSError):
            return None
        pids, cpu, io = [pid], 0.0, 0
        while pids:
            p = pids.pop()
            pids.extend(kids.get(p, ()))
            try:
                proc = self.proc if p == pid else psutil.Process(p)
                t = proc.cpu_times()
                cpu += t.user + t.system + t.children_user + t.children_system
                c = proc.io_counters()  # syscalls' bytes, and the disk's (page faults too)
                io += getattr(c, "read_chars", 0) + getattr(c, "write_chars", 0)
                io += c.read_bytes + c.write_bytes
                if p == pid and quiet_tid is not None:  # the memory sampler reading /proc
                    io -= _thread_io(pid, quiet_tid)  # is no progress (read right after)
            except (psutil.Error, OSError):
                continue
        return cpu, io, stopped


def _thread_io(pid: int, tid: int) -> int:
    """The characters one thread of ``pid`` read and wrote (0 when unreadable)."""
    n = 0
    try:
        with open(f"/proc/{pid}/task/{tid}/io") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("rchar", "wchar", "read_bytes", "write_bytes"):
                    n += int(value)
    except (OSError, ValueError):
        return 0
    return n


def _children() -> dict[int, list[int]]:
    """Parent pid -> child pids, of every process (one pass over /proc)."""
    import psutil

    kids: dict[int, list[int]] = {}
    for p in psutil.process_iter(["ppid"]):
        kids.setdefault(p.info["ppid"], []).append(p.pid)
    return kids


class HangGuard:
    """Watches one attempt's ranks (see the module)."""

    def __init__(
        self, run_dir: str, log_dir: str, world_size: int, hang_timeout: float | str | None
    ) -> None:
        self.run_dir = run_dir
        self.log_dir = log_dir
        self.world_size = world_size
        self.auto = hang_timeout == "auto"
        self.fixed = None if self.auto or hang_timeout is None else float(hang_timeout)
        now = time.monotonic()
        self._samplers = {r: _Sampler(now) for r in range(world_size)}
        self._steps: dict[int, tuple[int, float]] = {}
        self._step_times: deque[float] = deque(maxlen=2000)
        self.rings: dict[int, RingView | None] = {}
        self.hang: Hang | None = None
        self.places: tuple[RankPlace, ...] = ()
        self.stacks: dict[int, str] = {}
        self.workers: dict[int, list[str]] = {}
        self.flights: dict[int, FlightDump] = {}
        # No clean-up of the ranks' files here: a forked rank may have written them already.
        # The run clears them before each new attempt.

    @property
    def on(self) -> bool:
        return self.auto or self.fixed is not None

    @property
    def timeout(self) -> float:
        """T now (seconds)."""
        if self.fixed is not None:
            return self.fixed
        if not self._step_times:
            return AUTO_MIN_S
        times = sorted(self._step_times)
        p99 = times[min(len(times) - 1, int(0.99 * len(times)))]
        return max(AUTO_MIN_S, 3 * p99)

    @property
    def poll_interval(self) -> float:
        return min(0.5, max(0.05, self.timeout / 10))

    @property
    def stopped(self) -> set[int]:
        return {r for r, s in self._samplers.items() if s.stopped}

    # ------------------------------------------------------------------ sampling
    def _marks(self, r: int, ring: RingView | None) -> tuple[Any, ...]:
        rd = RunDir(self.run_dir)
        out: list[Any] = [None if ring is None else (ring.written, ring.records[-1:])]
        beat = beat_file.read(self.run_dir, r)
        out.append(None if beat is None else beat.time)
        for p in (log_path(self.log_dir, r), rd.progress(r)):
            try:
                st = os.stat(p)
                out.append((st.st_size, st.st_mtime_ns))
            except OSError:
                out.append(None)
        return tuple(out)

    def _steps_seen(self, r: int) -> None:
        rep = progress_file.read(self.run_dir, r)
        if rep is None:
            return
        prev = self._steps.get(r)
        if prev is not None and rep.step > prev[0] and rep.time > prev[1]:
            self._step_times.append((rep.time - prev[1]) / (rep.step - prev[0]))
        if prev is None or rep.step != prev[0]:
            self._steps[r] = (rep.step, rep.time)

    def sample(self, pids: dict[int, int], live: list[int], deep: bool = False) -> dict[int, float]:
        """Read every rank now; seconds each live rank has shown no progress. The process
        trees are sampled only while some rank waits in a collective (or when ``deep``):
        progress is measured from the first such sample."""
        now, wall = time.monotonic(), time.time()
        for r in live:
            self.rings[r] = ring_file.read(self.run_dir, r)
        soon = min(1.0, self.timeout / 3)
        deep = deep or any(
            (cur := None if v is None else v.current) is not None and wall - cur.entered >= soon
            for v in (self.rings.get(r) for r in live)
        )
        kids = _children() if deep else {}
        quiet = {}
        for r in live:
            s = self._samplers[r]
            marks = self._marks(r, self.rings[r])
            moved = marks != s.marks or not deep
            s.marks = marks
            pid = pids.get(r)
            if pid is None or not deep:
                tree = None
            else:
                mem = memory_file.read(self.run_dir, r)
                tree = s.tree(pid, kids, mem.sampler_tid if mem is not None else None)
            if tree is None:
                s.cpu = None  # the next deep sample starts afresh
            else:
                cpu, io, s.stopped = tree
                rose = cpu - (s.cpu or 0.0) > _CPU_SHARE * (now - s.cpu_at) + _TICK_S
                if s.cpu is None or rose or io != s.io:
                    moved = True
                s.cpu, s.io, s.cpu_at = cpu, io, now
            if moved and not s.stopped:
                s.progress_at = now
            quiet[r] = now - s.progress_at
            if self.auto:
                self._steps_seen(r)
        return quiet

    def check(self, live: list[int], pids: dict[int, int]) -> list[int]:
        """The holding ranks of a hang found now (empty: none)."""
        quiet = self.sample(pids, live)
        hang = verdict.judge(
            self.rings, quiet, self.stopped, self.world_size, self.timeout, time.time()
        )
        if hang is None:
            return []
        self.hang, self._quiet = hang, quiet
        return list(hang.holders)

    # ------------------------------------------------------------------ explaining
    def dump_stacks(self, pids: dict[int, int], live: list[int], wait: float = 1.5) -> None:
        """SIGUSR1 every live rank that is not stopped (a stopped one would dump only when
        continued), then the DataLoader workers of a holding rank that waits on them."""
        stopped = self.stopped
        ask = {r: pids[r] for r in live if r in pids and r not in stopped}
        self.stacks.update(stacks.request(self.run_dir, ask, wait))
        for r in live:
            self.stacks.setdefault(r, "")
        holders = () if self.hang is None else self.hang.holders
        for r in holders:
            if r in ask and "torch/utils/data" in self.stacks.get(r, ""):
                self.workers[r] = self._dump_workers(r, ask[r])
        self.flights = self._flights([r for r in live if r not in stopped])
        for r in stopped & set(live):  # continued: the teardown's SIGTERM then reaches it
            try:
                os.kill(pids[r], signal.SIGCONT)
            except (KeyError, OSError):
                pass

    def _flights(self, live: list[int], wait: float = 1.0) -> dict[int, FlightDump]:
        """torch's Flight Recorder of the ranks that keep one (`gangrun.rank.flight`)."""
        ready = [r for r in live if flight_file.read(self.run_dir, r) is not None]
        if not ready:
            return {}
        asked = flight_file.request(self.run_dir)
        deadline = time.monotonic() + wait
        got: dict[int, FlightDump] = {}
        while time.monotonic() < deadline and len(got) < len(ready):
            for r in ready:
                dump = flight_file.read(self.run_dir, r)
                if dump is not None and dump.time >= asked:
                    got[r] = dump
            time.sleep(0.05)
        return got

    def _dump_workers(self, rank: int, pid: int) -> list[str]:
        import psutil

        try:
            kids = sorted(psutil.Process(pid).children(), key=lambda p: p.pid)
        except psutil.Error:
            return []
        out = []
        for kid in kids:
            if not _catches_usr1(kid.pid):
                continue
            before = stack_file.size(self.run_dir, rank)
            try:
                os.kill(kid.pid, signal.SIGUSR1)
            except OSError:
                continue
            deadline, last = time.monotonic() + 1.0, -1
            while time.monotonic() < deadline:
                size = stack_file.size(self.run_dir, rank)
                if size > before and size == last:
                    break
                last = size
                time.sleep(0.05)
            out.append(stack_file.read_since(self.run_dir, rank, before).text)
        return out

    def _places(self, quiet: dict[int, float]) -> tuple[RankPlace, ...]:
        return verdict.places(
            self.hang, self.rings, quiet, self.stopped, self.stacks, self.workers,
            self.world_size, time.time(), self.flights,
        )  # fmt: skip

    def explain(self, pids: dict[int, int], live: list[int]) -> tuple[RankPlace, ...]:
        """Where each rank is now (for a call out of time): read, dump the stacks, say."""
        quiet = self.sample(pids, live, deep=True)
        self.dump_stacks(pids, live)
        self.places = self._places(quiet)
        return self.places

    def error(
        self, fn_name: str, run_id: str | None, log_dir: str, ending: str = ""
    ) -> DistributedHangError:
        from dataclasses import replace

        from ..errors import DistributedHangError

        assert self.hang is not None
        hang = self.hang = replace(self.hang, places=self._places(self._quiet))
        msg = verdict.message(fn_name, hang, self.world_size, self.stacks, log_dir, ending)
        return DistributedHangError(
            msg,
            rank=hang.holders[0],
            run_id=run_id,
            ranks=list(hang.holders),
            stacks=dict(self.stacks),
            hang=hang,
        )

    _quiet: dict[int, float] = {}


__all__ = ["AUTO_MIN_S", "HangGuard", "last_progress"]
