"""The supervisor of one call: acquires, launches, watches, restarts, collects, tears down.

It owns what it acquired (GPU reservation, run directory, the MLflow run, the gang and its
output pump) and releases all of it on ONE path, `_end`, for a partial start, an interrupt,
a failure and a normal end alike. A monitor thread waits on the call's event queue, which
carries the gang's rank exits and the lifecycle's own events (cancel); the deadline and the
hang guard are the queue wait's timeout (no polling on the exit path: a failure is seen as
soon as its waiter thread reports it).
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from ..host.system import reap_stale, remove_unrecorded
from ..launch import Gang, GangSpec, RankExit, open_gang
from ..options import Options
from ..wire import serialization
from ..wire.records import RankContext
from ..wire.rundir import RunDir, create
from . import calls, monitor
from . import snapshots as snapshots
from .attempts import Restarts, annotate
from .checkpoints import prepare, release_location, request_stop
from .collect import RankFiles
from .done import DoneEvent, DoneHook
from .observers import MlflowObserver, NoticeObserver, Observer, Observers
from .plan import check_gpu_type, function_name, rank_context, rank_specs
from .policy import Decision
from .record import CallerKind, CallRecord, new_run_id, tracking_info
from .seams import (
    GangFactory,
    Planner,
    PumpFactory,
    QueueItem,
    TrackingStart,
    default_planner,
    make_pump,
    start_tracking,
)
from .state import (
    Attempt,
    CancelRequested,
    LaunchFailed,
    Outcome,
    PreemptRequested,
    State,
    StateMachine,
)
from .watch import watching

if TYPE_CHECKING:
    from ..host.accelerators import Accelerator
    from ..host.keeper import Keeper
    from ..host.reservation import Reservation
    from ..output import OutputPump
    from ..tracking.caller import Tracker

log = logging.getLogger("gangrun.lifecycle.supervisor")


class Supervisor:
    """One call. Made with everything it needs: the call is planned (side-effect free; bad
    options are a ``LaunchError`` here) into its frozen `CallRecord`, and every observer is
    given (``observers`` first, then the built-in ones); nothing is added later."""

    def __init__(
        self,
        fn: Callable[..., Any],
        args: tuple,
        kwargs: dict[str, Any],
        options: Options,
        *,
        stdout: IO[str] | None = None,
        stderr: IO[str] | None = None,
        gang_factory: GangFactory = open_gang,
        planner: Planner = default_planner,
        pump_factory: PumpFactory = make_pump,
        tracking: TrackingStart = start_tracking,
        observers: Sequence[Observer] = (),
        caller: CallerKind = "script",
    ) -> None:
        plan, placement = planner(fn, options)
        out, err = stdout or sys.stdout, stderr or sys.stderr
        self.call = CallRecord(
            new_run_id(),
            function_name(fn),
            plan,
            options,
            out,
            err,
            fn,
            args,
            kwargs,
            placement,
            caller,
        )
        self.owner_pid = os.getpid()
        self.outcome = Outcome()
        self.rundir: RunDir | None = None
        self.gang: Gang | None = None  # the running attempt's
        self.watch, watchers = watching(self)  # progress, DEBUG narration, `gangrun ps/stop`
        self._observers = Observers([*observers, *watchers, MlflowObserver(), NoticeObserver()])
        self._gang_factory, self._pump_factory, self._track = gang_factory, pump_factory, tracking
        self._machine = StateMachine(
            self.outcome, lambda st, _: self._observers.on_transition(st, self)
        )
        self._restarts = Restarts(options, self)  # the rules: lifecycle/policy.py
        self._attempt = 0
        self._tracker: Tracker | None = None
        self._context: RankContext | None = None
        self._files: RankFiles
        self._pump: OutputPump | None = None
        self._gang_open = False
        self._devices: list[Accelerator] = []
        self._reservation: Reservation | None = None
        self._events: queue.Queue[QueueItem] | None = None
        self._cancel_reason: str | None = None
        self._preempt = threading.Event()  # a preemption was asked for (cancel(checkpoint=True))
        self.ckpt_env: dict[str, str] = {}  # checkpoints: the ranks' env (lifecycle/checkpoints)
        self._keeper: Keeper | None = None  # memory snapshots' keeper (lifecycle/memory)
        self._lock = threading.Lock()
        self._done = DoneEvent()  # hooks: the handle's future state, its callbacks
        self._released = False
        self._thread: threading.Thread | None = None
        self._started = 0.0

    # ---------------------------------------------------------------- public face
    @property
    def run_id(self) -> str:
        return self.call.run_id

    @property
    def fn_name(self) -> str:
        return self.call.fn_name

    @property
    def world_size(self) -> int:
        return self.call.world_size

    @property
    def opts(self) -> Options:
        return self.call.options

    @property
    def attempt(self) -> int:
        """The attempt running (0: the first)."""
        return self._attempt

    @property
    def devices(self) -> list[Accelerator]:
        """The GPUs reserved for the call."""
        return list(self._devices)

    @property
    def tracker(self) -> Tracker | None:
        """The MLflow run's tracker (``gangrun.tracking.Tracker``), once created."""
        return self._tracker

    @property
    def run_dir(self) -> str:
        return "" if self.rundir is None else self.rundir.path

    @property
    def log_dir(self) -> str:
        return "" if self.rundir is None else self.rundir.logs

    @property
    def state(self) -> State:
        return self.outcome.state

    @property
    def mlflow_run_id(self) -> str | None:
        return None if self._tracker is None else str(self._tracker.run_id)

    @property
    def started(self) -> bool:
        return self._thread is not None

    def log_files(self) -> dict[int, str]:
        rd = self.rundir
        return {} if rd is None else {r: rd.log(r) for r in range(self.world_size)}

    def done(self) -> bool:
        return self._done.is_set()

    def on_done(self, hook: DoneHook) -> None:
        self._done.subscribe(hook)  # hook.settle() before done() turns True, notify() after

    def wait(self, timeout: float | None = None) -> bool:
        # In slices: the main thread stays responsive to KeyboardInterrupt (also one raised by
        # _thread.interrupt_main()); the event still wakes the waiter at once at the end.
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = 0.25 if deadline is None else min(0.25, deadline - time.monotonic())
            if self._done.wait(max(0.0, left)):
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False

    def result(self) -> list[Any]:
        """The per-rank results (raises the call's error); only once the call is done."""
        if self.outcome.error is not None:
            raise self.outcome.error
        if self.outcome.results is None:
            raise RuntimeError(f"call {self.run_id} has not finished")
        return self.outcome.results

    def cancel(
        self, reason: str = "cancelled", wait: float | None = 30.0, checkpoint: bool = False
    ) -> bool:
        """Stop every rank; True if the call was still running. Travels as a
        `CancelRequested` event. ``checkpoint``: the ranks save and stop first."""
        if self._done.is_set():
            return False
        if checkpoint and self.ckpt_env:  # a preemption: lifecycle/checkpoints.py
            self._preempt.set()  # before the stop request is written (see _monitor)
            if self._events is not None:  # it ends a back-off; a running attempt's ranks save
                self._events.put(PreemptRequested())
            return request_stop(self, wait)
        with self._lock:
            if self._cancel_reason is None:
                self._cancel_reason = reason
            events = self._events
        if events is not None:
            events.put(CancelRequested(reason))
        self.wait(wait)  # seconds for the end (None: until it has ended)
        return True

    def release(self) -> None:
        """The handle is gone: remove the run directory now, or when the call ends."""
        if os.getpid() != self.owner_pid:
            return  # a forked child: the directory is the parent's
        with self._lock:
            self._released, done = True, self._done.is_set()
        if done:
            self.remove_dir()

    def remove_dir(self) -> None:
        if os.getpid() != self.owner_pid:
            return
        if self.rundir is not None:
            self.rundir.remove()
        else:  # maybe interrupted between creating the directory and keeping it
            remove_unrecorded(self.call.run_id)

    # ---------------------------------------------------------------- start
    def start(self) -> None:
        """Acquire, launch the first attempt and start the monitor (the call was planned when
        the supervisor was made). Raises (after releasing everything acquired) when the call
        cannot start."""
        self._started = time.monotonic()
        try:
            self._acquire()
            self._launch_attempt()
            calls.add(self)
            self._thread = threading.Thread(
                target=self._monitor, name=f"gangrun-run-{self.run_id}", daemon=True
            )
            self._thread.start()
        except BaseException as exc:
            self._thread = None
            self._end(LaunchFailed(exc))
            raise

    def _acquire(self) -> None:
        call, opts = self.call, self.call.options
        self._observers.on_plan(self)  # e.g. the panel: "starting N ranks..."
        self._context = rank_context(opts)
        if call.plan.gpus_wanted:
            from ..host.reservation import reserve_wanted

            plan = call.plan
            self._reservation = reserve_wanted(plan.devices, plan.gpus_wanted, opts.gpu_wait)
            self._devices = list(self._reservation.devices)
            check_gpu_type(self._devices, opts.gpu_type)
        reap_stale()
        self.rundir = create(call.run_id, opts.log_dir)
        self.rundir.write_context(self._context)
        from ..rank.source import with_sources  # notebook code: its source travels along

        serialization.write_payload(
            self.rundir.payload, with_sources(call.fn), call.args, call.kwargs,
            opts.max_capture_bytes,
        )  # fmt: skip
        if opts.mlflow:  # bad tracking input: a LaunchError, nothing started
            gpu = self._devices[0].name if self._devices else None
            self._tracker = self._track(tracking_info(call, gpu), call.stdout)
        self.ckpt_env = prepare(self)  # a checkpoint_dir that cannot be used: a LaunchError
        on_ray = call.placement is not None
        self._keeper, mem_env = snapshots.start(
            opts, call.run_id, self.ckpt_env, on_ray, call.stderr
        )
        self.ckpt_env.update(mem_env)

    def _launch_attempt(self) -> None:
        assert self.rundir is not None and self._context is not None
        call, opts = self.call, self.call.options
        self._machine.to(State.LAUNCHING)
        events: queue.Queue[QueueItem] = queue.Queue()
        with self._lock:
            self._events = events
            if self._cancel_reason is not None:  # cancelled while restarting
                events.put(CancelRequested(self._cancel_reason))
        self._files = RankFiles(
            self.rundir, call.world_size, call.run_id, opts.grace_period, call.fn_name
        )
        tracked = {} if self._tracker is None else dict(self._tracker.rank_env())
        tracked.update(self.ckpt_env)
        spec = GangSpec(
            run_id=call.run_id,
            run_dir=self.rundir.path,
            ranks=rank_specs(
                call.plan,
                opts,
                run_dir=self.rundir.path,
                run_id=call.run_id,
                devices=self._devices,
                attempt=self._attempt,
                tracking_env=tracked,
            ),
            log_dir=self.rundir.logs,
            output=opts.output,
            grace_period=opts.grace_period,
            cwd=self._context.cwd,
            start_method=opts.start_method,
            forkserver=opts.forkserver,
        )
        if call.placement is not None:
            from .ray_plan import ship_env

            ship_env(spec, opts, call.placement, tracked)
        lines = self._observers.on_rank_line if self._observers.line_listeners else None
        named = (call.fn_name, call.run_id)  # prefixed while another call shares the output
        self._pump = self._pump_factory(call.stdout, call.stderr, opts.output, lines, *named)
        self.gang = self._gang_factory(spec, self._pump, events)
        self._gang_open = True
        self.gang.start()
        self._restarts.launched()
        self._machine.to(State.RUNNING)

    # ---------------------------------------------------------------- monitor
    def _monitor(self) -> None:
        try:
            while True:
                attempt = self._watch_attempt()
                self.outcome.attempts.append(attempt)
                assert self.rundir is not None  # progress is read before the files are cleared
                verdict = self._restarts.after(attempt, self.rundir.path, self.world_size)
                if verdict.decision is Decision.RESTART and self._cancel_reason is None:
                    self._machine.to(State.RESTARTING)
                    self.rundir.clear_attempt()  # first: a later stop request is for the next ranks
                    asked = (lambda: self._cancel_reason), self._preempt.is_set
                    waited = self._restarts.back_off(
                        verdict.backoff, self._events, self._started, *asked
                    )
                    if waited is None:
                        self._attempt += 1
                        if self.opts.min_ranks and self.call.placement is not None:
                            from .ray_plan import resize  # after a lost node

                            lost = self.gang.spawner.lost_nodes if self.gang else set()
                            self.call = resize(self.call, lost)
                        self._launch_attempt()
                        continue
                    attempt = waited  # cancelled or out of time while waiting to restart
                annotate(attempt.error, self.outcome.attempts, self.opts.max_restarts)
                self._end(attempt)
                return
        except BaseException as exc:  # a bug in gangrun itself: the call still ends, cleanly
            log.exception("the monitor of call %s failed", self.run_id)
            self._end(exc)

    def _watch_attempt(self) -> Attempt:
        assert self.rundir is not None and self.gang is not None and self._events is not None
        gang, n, timeout = self.gang, self.world_size, self.opts.timeout
        deadline = None if timeout is None else self._started + timeout
        from .hang import HangGuard  # the verdict (hang_timeout), and the timeout's "where"

        guard = None  # Ray ranks run on other nodes: their files and processes are not here
        if self.call.placement is None:
            guard = HangGuard(self.rundir.path, self.rundir.logs, n, self.opts.hang_timeout)
        remaining, exits = set(range(n)), dict[int, RankExit]()
        try:
            ending = monitor.wait_attempt(
                self._events, remaining, exits, deadline, timeout, guard, lambda: gang.pids,
                lambda: self._cancel_reason, self._observers.on_rank_exit, self._files.exit_failed,
            )  # fmt: skip
        finally:
            self._machine.to(State.STOPPING)
            teardown_at = time.time()
            self._close_gang(stop=bool(remaining), grace=None)
        monitor.late_exits(self._events, exits, self._observers.on_rank_exit)
        attempt, self.outcome.results = self._files.ended(
            self._attempt, ending, exits, teardown_at, dict(gang.pids), guard
        )
        return attempt

    # ---------------------------------------------------------------- the one teardown
    def _close_gang(self, stop: bool, grace: float | None) -> None:
        gang, pump = self.gang, self._pump
        if gang is None or not self._gang_open:
            return
        self._gang_open = False
        try:
            if stop:
                gang.stop(grace)
            else:
                gang.reap_leftovers()
        finally:
            try:
                if pump is not None:
                    pump.close(drain_timeout=2.0 if grace is None else 0.5)
            finally:
                gang.close()

    def _end(self, how: Attempt | LaunchFailed | BaseException) -> None:
        """End the call, from any state: stop what runs, settle the outcome, tell the
        observers, release what was acquired. Every step runs even if one before it raised;
        the call is always marked done."""
        if isinstance(how, Attempt):
            state, error = how.state, how.error
        else:
            exc = how.exc if isinstance(how, LaunchFailed) else how
            state = State.FAILED if isinstance(exc, Exception) else State.CANCELLED
            error = exc
        launch_failed = isinstance(how, LaunchFailed)
        steps: list[tuple[str, Callable[[], None]]] = [
            ("stop the gang", lambda: self._close_gang(stop=True, grace=0.0)),
            ("free the memory snapshots", lambda: snapshots.stop(self._keeper)),
            ("release the checkpoint location", lambda: release_location(self.run_id)),
            ("release the GPUs", self._release_gpus),
            ("settle the outcome", lambda: self._settle(state, error)),
        ]
        if self.rundir is not None:
            rd = self.rundir
            steps += [("remove the payload", lambda: Path(rd.payload).unlink(missing_ok=True))]
            steps += [("clear the attempt files", rd.clear_attempt)]
        try:
            for what, step in steps:
                try:
                    step()
                except Exception:
                    log.exception("call %s: could not %s", self.run_id, what)
        finally:
            calls.discard(self)
            with self._lock:
                remove = launch_failed or self._released
            if remove:
                self.remove_dir()
            self._done.set()

    def _settle(self, state: State, error: BaseException | None) -> None:
        self.outcome.error = error
        if state is not State.SUCCEEDED:
            self.outcome.results = None
        current = self.outcome.state
        if current.terminal:
            return
        if current is State.RUNNING and state is not State.FAILED:
            self._machine.to(State.STOPPING)
        self._machine.to(state)

    def _release_gpus(self) -> None:
        res, self._reservation = self._reservation, None
        if res is not None:
            res.release()


__all__ = ["Supervisor", "GangFactory", "Planner", "default_planner"]
