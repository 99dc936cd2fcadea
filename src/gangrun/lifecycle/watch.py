"""Watching a running call: progress and ETA, slow and silent ranks, stacks on demand.

Everything here is read from the run directory on request (the panel's redraw, the CLI's
status line, ``handle.progress()``): no thread of its own, nothing on the training path.

- **Progress** comes from the ranks' step reports (`gangrun.report_step`, read with
  `gangrun.wire.progress.read_all`). When no rank reports, there is no progress: nothing is
  guessed. The gang's step is its slowest rank's; the ETA is that rank's remaining steps at
  its recent rate.
- **A slow rank** is one whose recent rate (over `RATE_WINDOW_S`) stays under
  `SLOW_RATIO` x the median of the other ranks' for `SLOW_AFTER_S` seconds
  (``GANGRUN_SLOW_AFTER`` overrides it). It is marked with its ratio until it catches up.
- **Memory**: every rank's last memory sample (`gangrun.wire.memory`: resident memory of its
  process tree against its limit, CUDA allocated/reserved), in ``Progress.memory``.
- **A silent rank** made no progress at all (no output, heartbeat or step report) for
  `SILENT_AFTER_S` seconds (``GANGRUN_SILENT_AFTER``): the panel suggests
  ``handle.stacks()``.

At the end of the call the last values go on the MLflow run (metrics ``gangrun.step``,
``gangrun.total_steps``, ``gangrun.steps_per_second``; tag ``gangrun.slow_ranks``).
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections import deque
from dataclasses import replace
from typing import TYPE_CHECKING

from ..progress_view import Progress, RankProgress, summary_line
from ..wire import contract
from ..wire import memory as memory_file
from ..wire.progress import StepReport, read_all
from ..wire.tags import METRIC_PREFIX, TAG_SLOW_RANKS
from .observers import CallView, Observer
from .state import State

if TYPE_CHECKING:
    from ..tracking.caller import Tracker

log = logging.getLogger("gangrun.lifecycle.watch")

SLOW_RATIO = 0.8  # a rank under this fraction of the others' median rate...
SLOW_AFTER_S = 60.0  # ...for this long is slow (GANGRUN_SLOW_AFTER)
SILENT_AFTER_S = 120.0  # no progress at all for this long: silent (GANGRUN_SILENT_AFTER)
RATE_WINDOW_S = 20.0  # a rank's current rate: over its reports of the last this many seconds
MIN_SAMPLE_S = 0.2  # the run directory is read at most this often


def _seconds(env: str, default: float) -> float:
    from .. import settings

    s = settings.read(env)
    if s.rejected is not None:
        log.warning("%s=%r is %s; using %g", env, s.rejected, s.why, default)
    return settings.seconds_in_force(env, default)


def slow_after() -> float:
    return _seconds(contract.SLOW_AFTER, SLOW_AFTER_S)


def silent_after() -> float:
    return _seconds(contract.SILENT_AFTER, SILENT_AFTER_S)


class ProgressTracker:
    """Turns successive step reports into rates, the ETA and slow/silent marks (pure: the
    reports and the clock are given, so tests drive it with any timeline)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._samples: dict[int, deque[tuple[float, int]]] = {}
        self._below_since: dict[int, float] = {}
        self._first_time: dict[int, float] = {}

    def reset(self) -> None:
        """A new attempt: its reports start afresh."""
        self._samples.clear()
        self._below_since.clear()
        self._first_time.clear()

    def _rate(self, rep: StepReport) -> float | None:
        q = self._samples.get(rep.rank)
        if not q:
            return rep.rate
        t1, s1 = q[-1]
        for t0, s0 in q:
            if t1 - t0 <= RATE_WINDOW_S:
                if t1 > t0 and s1 > s0:
                    return (s1 - s0) / (t1 - t0)
                break
        return rep.rate

    def update(
        self,
        reports: dict[int, StepReport],
        now: float,
        last_progress: dict[int, float] | None = None,
    ) -> Progress:
        """The progress at ``now`` (wall clock) given every rank's last report and, for the
        silent mark, when each live rank last made any progress."""
        for r, rep in reports.items():
            if self._first_time.get(r) != rep.first_time:  # a new attempt of that rank
                self._first_time[r] = rep.first_time
                self._samples[r] = deque()
                self._below_since.pop(r, None)
            q = self._samples[r]
            if not q or q[-1][0] != rep.time:
                q.append((rep.time, rep.step))
            while len(q) > 2 and rep.time - q[1][0] > RATE_WINDOW_S:
                q.popleft()
        rates = {r: self._rate(rep) for r, rep in reports.items()}
        slow = self._slow(rates, now)
        silent_s = silent_after()
        ranks: dict[int, RankProgress] = {}
        for r in range(self.world_size):
            got = reports.get(r)
            quiet = None
            if last_progress is not None and r in last_progress:
                idle = now - last_progress[r]
                quiet = idle if idle >= silent_s else None
            if got is None and quiet is None:
                continue
            ranks[r] = RankProgress(
                r,
                step=None if got is None else got.step,
                total=None if got is None else got.total,
                rate=rates.get(r),
                slow_ratio=slow.get(r),
                silent_for=quiet,
            )
        if not reports:
            return Progress(ranks=ranks)
        last = min(reports.values(), key=lambda rep: rep.step)
        totals = [rep.total for rep in reports.values() if rep.total]
        total = max(totals) if totals else None
        known = [v for v in rates.values() if v]
        rate = statistics.median(known) if known else None
        eta = None
        own = rates.get(last.rank)
        if total is not None and own:
            eta = max(0.0, (total - last.step) / own)
        resumed = [rep.resumed_from for rep in reports.values() if rep.resumed_from is not None]
        worlds = [rep.saved_world for rep in reports.values() if rep.saved_world is not None]
        return Progress(
            step=last.step,
            total=total,
            rate=rate,
            eta_s=eta,
            resumed_from=min(resumed) if resumed else None,
            resumed_world=worlds[0] if resumed and worlds else None,
            ranks=ranks,
        )

    def _slow(self, rates: dict[int, float | None], now: float) -> dict[int, float]:
        after = slow_after()
        out: dict[int, float] = {}
        for r, rate in rates.items():
            others = [v for o, v in rates.items() if o != r and v]
            ratio = None
            if rate is not None and others:
                ratio = rate / statistics.median(others)
            if ratio is None or ratio >= SLOW_RATIO:
                self._below_since.pop(r, None)
                continue
            since = self._below_since.setdefault(r, now)
            if now - since >= after:
                out[r] = ratio
        return out


def with_causes(p: Progress, run: CallView, now: float) -> Progress:
    """The slow ranks' causes, from the ranks' collective records (`verdict.slow_cause`)."""
    if not p.slow or not run.run_dir:
        return p
    import dataclasses

    from ..wire import collectives
    from .verdict import slow_cause

    rings = {r: collectives.read(run.run_dir, r) for r in range(run.call.world_size)}
    ranks = dict(p.ranks)
    for r in p.slow:
        cause = slow_cause(rings, r, now, RATE_WINDOW_S)
        if cause:
            ranks[r] = dataclasses.replace(ranks[r], slow_cause=cause)
    return dataclasses.replace(p, ranks=ranks)


class Watch:
    """The watching side of one call (``run.watch``): `progress` reads the run
    directory (at most every `MIN_SAMPLE_S`), `stacks` asks the ranks."""

    def __init__(self, run: CallView) -> None:
        self.run = run
        self._lock = threading.Lock()
        self._tracker: ProgressTracker | None = None
        self._last: Progress = Progress()
        self._sampled = 0.0
        self._attempt_started = time.time()
        self._frozen = False

    def freeze(self) -> Progress:
        """The call ended: read the reports one last time and keep that."""
        p = self.progress(fresh=True)
        self._frozen = True
        return p

    def new_attempt(self) -> None:
        with self._lock:
            self._attempt_started = time.time()
            if self._tracker is not None:
                self._tracker.reset()

    def progress(self, fresh: bool = False) -> Progress:
        """The call's progress now (``Progress().reported`` is False when no rank reports)."""
        run = self.run
        world = run.call.world_size
        if not run.run_dir or not world or self._frozen:
            return self._last  # after the end: the last values (the files are gone)
        with self._lock:
            now = time.time()
            if not fresh and now - self._sampled < MIN_SAMPLE_S:
                return self._last
            self._sampled = now
            if self._tracker is None:
                self._tracker = ProgressTracker(world)
            reports = read_all(run.run_dir, world)
            live = self._live_ranks()
            last_progress = None
            if live:
                from .hang import last_progress as lp

                since = self._attempt_started
                last_progress = {r: lp(run.run_dir, run.log_dir, r, since) for r in live}
            p = with_causes(self._tracker.update(reports, now, last_progress), run, now)
            memory = memory_file.read_all(run.run_dir, world)  # the panel's memory column
            self._last = replace(p, memory=memory) if memory else p
            return self._last

    def _live_ranks(self) -> list[int]:
        gang = self.run.gang
        if gang is None or self.run.state is not State.RUNNING:
            return []
        return list(gang.alive())

    def stacks(self, wait: float = 5.0) -> dict[int, str]:
        """Every live rank's Python stacks (all threads) now; the call keeps running."""
        from ..rank import stacks

        run = self.run
        if run.call.placement is not None:
            raise NotImplementedError(
                "stacks() works for ranks on this node only (backend='local'); on Ray, use "
                "`ray stack` or the Ray dashboard"
            )
        gang = run.gang
        if gang is None or run.done() or not run.run_dir:
            return {}
        live = set(self._live_ranks())
        pids = {r: p for r, p in dict(gang.pids).items() if r in live}
        return stacks.request(run.run_dir, pids, wait)


class ProgressObserver(Observer):
    """Resets the rates at each attempt; has the ranks' memory logged with the system metrics;
    at the end puts the last values on the MLflow run."""

    def __init__(self, watch: Watch) -> None:
        self.watch = watch

    def on_transition(self, state: State, run: CallView) -> None:
        if state is State.LAUNCHING:
            self.watch.new_attempt()
        elif state is State.RUNNING and run.tracker is not None and run.run_dir:
            run.tracker.watch_rank_memory(run.run_dir, run.call.world_size)
        elif state.terminal:
            p = self.watch.freeze()
            tracker = run.tracker
            if p.reported and tracker is not None:
                log_final(tracker, p)


def log_final(tracker: Tracker, p: Progress) -> None:
    """The last progress values on the call's MLflow run (best effort)."""
    from mlflow.entities import Metric

    ms = int(time.time() * 1000)
    step = int(p.step or 0)
    values = {"step": float(step), "total_steps": p.total, "steps_per_second": p.rate}
    metrics = [
        Metric(METRIC_PREFIX + k, float(v), ms, step) for k, v in values.items() if v is not None
    ]
    try:
        tracker.client.log_batch(tracker.run_id, metrics=metrics, synchronous=True)
        if p.slow:
            text = ", ".join(f"{r} ({x:.2f}x)" for r, x in sorted(p.slow.items()))
            tracker.client.set_tag(tracker.run_id, TAG_SLOW_RANKS, text)
    except Exception as exc:
        log.debug("could not log the final progress: %s", exc)


def watching(run: CallView) -> tuple[Watch, list[Observer]]:
    """``run``'s `Watch` (``run.watch``), and the built-in observers that go before MLflow's:
    the DEBUG narration, the progress (its final values reach MLflow before the run ends),
    the node record and control socket (`gangrun.lifecycle.control`)."""
    from .._log import configure
    from . import control, narrate

    configure()  # GANGRUN_LOG_LEVEL (once per process)
    watch = Watch(run)
    return watch, [*narrate.attach(run), ProgressObserver(watch), *control.attach(run)]


__all__ = [
    "Progress",
    "RankProgress",
    "ProgressTracker",
    "Watch",
    "ProgressObserver",
    "watching",
    "summary_line",
    "SLOW_RATIO",
    "SLOW_AFTER_S",
    "SILENT_AFTER_S",
]
