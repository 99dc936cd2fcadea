"""The supervisor of one call: acquires, launches, watches, restarts, collects, tears down.

It owns what it acquired (GPU reservation, run directory, the gang and its output pump; the
MLflow run through its observer) and releases all of it on ONE path, `_finish`, for a
partial start, an interrupt, a failure and a normal end alike. A monitor thread waits on the
call's event queue, which carries the gang's rank exits and the lifecycle's own events
(cancel); the deadline and the hang guard are the queue wait's timeout (no polling on the
exit path: a failure is seen as soon as its waiter thread reports it).
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import IO, TYPE_CHECKING, Any

from .. import serialization
from ..errors import DistributedCancelledError, DistributedError, DistributedTimeoutError
from ..launch import Gang, GangSpec, RankExit, RayPlacement, open_gang
from ..options import Options
from ..records import RankContext
from ..rundir import RunDir, create, reap_stale
from . import calls
from .attempts import Restarts, annotate
from .checkpoints import prepare, request_stop
from .collect import RankFiles
from .done import DoneEvent, DoneHook
from .observers import CallInfo, MlflowObserver, NoticeObserver, Observer, notify, tell
from .plan import Plan, check_gpu_type, rank_context, rank_specs, tracking_info
from .policy import Decision
from .seams import GangFactory, Planner, PumpFactory, QueueItem, default_planner, make_pump
from .state import (
    Attempt,
    CancelRequested,
    DeadlineReached,
    Event,
    HangDetected,
    LaunchFailed,
    Outcome,
    RankExited,
    State,
    StateMachine,
)
from .watch import Watch, watching

if TYPE_CHECKING:
    from ..accelerators import Accelerator
    from ..hang import HangGuard
    from ..output import OutputPump
    from ..reservation import Reservation
    from ..tracking.caller import Tracker

log = logging.getLogger("gangrun.lifecycle.supervisor")


class Supervisor:
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
        observers: list[Observer] | None = None,
    ) -> None:
        self.fn, self.args, self.kwargs, self.opts = fn, args, kwargs, options
        self.stdout = stdout if stdout is not None else sys.stdout
        self.stderr = stderr if stderr is not None else sys.stderr
        self.owner_pid = os.getpid()
        self._gang_factory, self._planner, self._pump_factory = gang_factory, planner, pump_factory
        self.outcome = Outcome()
        self._machine = StateMachine(self.outcome, self._notify)
        self._mlflow: MlflowObserver | None = None
        self.watch: Watch | None = None  # progress, slow ranks, stacks: set by watching()
        if observers is None:
            observers = [NoticeObserver()]
            if options.mlflow:
                self._mlflow = MlflowObserver()
                observers.insert(0, self._mlflow)
            observers[:0] = watching(self)  # DEBUG narration, progress, `gangrun ps/stop`
        self.observers = observers
        self.plan: Plan | None = None
        self.placement: RayPlacement | None = None
        self.context: RankContext | None = None
        self.rundir: RunDir | None = None
        self._files: RankFiles
        self.call = CallInfo("", getattr(fn, "__qualname__", repr(fn)), stdout=self.stdout)
        self.call.stderr, self.call.max_restarts = self.stderr, options.max_restarts
        self._restarts = Restarts(options, self.call)  # the rules: lifecycle/policy.py
        self.gang: Gang | None = None
        self.pump: OutputPump | None = None
        self._gang_open = False
        self.devices: list[Accelerator] = []
        self._reservation: Reservation | None = None
        self._events: queue.Queue[QueueItem] | None = None
        self._cancel_reason: str | None = None
        self.ckpt_env: dict[str, str] = {}  # checkpoints: the ranks' env (lifecycle/checkpoints)
        self._lock = threading.Lock()
        self._done = DoneEvent()  # hooks: the handle's future state, its callbacks
        self._released = False
        self._thread: threading.Thread | None = None
        self._started = 0.0
        # what the handle shows: known once planned (run id, world) and acquired (dirs)
        self.run_id, self.fn_name, self.world_size = "", self.call.fn_name, 0
        self.run_dir = self.log_dir = ""

    # ---------------------------------------------------------------- public face
    @property
    def state(self) -> State:
        return self.outcome.state

    @property
    def tracker(self) -> Tracker | None:
        """The MLflow run's tracker (``gangrun.tracking.Tracker``), once created."""
        return None if self._mlflow is None else self._mlflow.tracker

    @property
    def mlflow_run_id(self) -> str | None:
        return None if self._mlflow is None else self._mlflow.run_id

    @property
    def started(self) -> bool:
        return self._thread is not None

    def log_files(self) -> dict[int, str]:
        if self.rundir is None:
            return {}
        return {r: self.rundir.log(r) for r in range(self.world_size)}

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
        self, reason: str = "cancelled", wait: float = 30.0, checkpoint: bool = False
    ) -> bool:
        """Stop every rank; True if the call was still running. Travels as a
        `CancelRequested` event. ``checkpoint``: the ranks save and stop first."""
        if self._done.is_set():
            return False
        if checkpoint and self.ckpt_env:  # a preemption: lifecycle/checkpoints.py
            return request_stop(self, wait)
        with self._lock:
            if self._cancel_reason is None:
                self._cancel_reason = reason
            events = self._events
        if events is not None:
            events.put(CancelRequested(reason))
        self._done.wait(wait)
        return True

    def release(self) -> None:
        """The handle is gone: remove the run directory now, or when the call ends."""
        if os.getpid() != self.owner_pid:
            return  # a forked child: the directory is the parent's
        with self._lock:
            self._released = True
            done = self._done.is_set()
        if done:
            self.remove_dir()

    def remove_dir(self) -> None:
        if self.rundir is not None and os.getpid() == self.owner_pid:
            self.rundir.remove()

    # ---------------------------------------------------------------- start
    def start(self) -> None:
        """Plan, acquire, launch the first attempt and start the monitor. Raises (after
        releasing everything acquired) when the call cannot start."""
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
        plan, self.placement = self._planner(self.fn, self.opts)
        self.plan = plan
        self.call.run_id, self.call.fn_name = plan.run_id, plan.fn_name
        self.call.world_size = plan.world_size
        self.run_id, self.fn_name, self.world_size = plan.run_id, plan.fn_name, plan.world_size
        tell(self.observers, "on_plan", self.call)  # e.g. the panel: "starting N ranks..."
        self.context = rank_context(self.opts)
        if plan.gpus_wanted:
            from ..reservation import reserve_wanted

            self._reservation = reserve_wanted(plan.devices, plan.gpus_wanted, self.opts.gpu_wait)
            self.devices = list(self._reservation.devices)
            check_gpu_type(self.devices, self.opts.gpu_type)
            plan.gpu_name = self.devices[0].name
        reap_stale()
        self.rundir = create(plan.run_id, self.opts.log_dir)
        self.run_dir, self.log_dir = self.rundir.path, self.rundir.logs
        self.call.log_files = self.log_files()
        self.rundir.write_context(self.context)
        from ..notebook.source import with_sources  # notebook code: its source travels along

        serialization.write_payload(
            self.rundir.payload,
            with_sources(self.fn),
            self.args,
            self.kwargs,
            self.opts.max_capture_bytes,
        )
        if self._mlflow is not None:
            self.call.tracking = tracking_info(plan, self.opts, self.fn, self.args, self.kwargs)
            self._mlflow.start(self.call)  # bad tracking input: a LaunchError, nothing started
        self.ckpt_env = prepare(self)  # a checkpoint_dir that cannot be used: a LaunchError

    def _launch_attempt(self) -> None:
        assert self.plan is not None and self.rundir is not None and self.context is not None
        self._machine.to(State.LAUNCHING)
        events: queue.Queue[QueueItem] = queue.Queue()
        with self._lock:
            self._events = events
            if self._cancel_reason is not None:  # cancelled while restarting
                events.put(CancelRequested(self._cancel_reason))
        self._files = RankFiles(
            self.rundir, self.plan.world_size, self.run_id, self.opts.grace_period, self.fn_name
        )
        tracked: dict[str, str] = {}
        for obs in self.observers:
            tracked.update(obs.rank_env())
        tracked.update(self.ckpt_env)
        spec = GangSpec(
            run_id=self.plan.run_id,
            run_dir=self.rundir.path,
            ranks=rank_specs(
                self.plan,
                self.opts,
                run_dir=self.rundir.path,
                devices=self.devices,
                attempt=self.call.attempt,
                tracking_env=tracked,
            ),
            log_dir=self.rundir.logs,
            output=self.opts.output,
            grace_period=self.opts.grace_period,
            cwd=self.context.cwd,
            start_method=self.opts.start_method,
        )
        if self.placement is not None:
            from .ray_plan import ship_env

            ship_env(spec, self.opts, self.placement, tracked)
        listeners = [o for o in self.observers if o.wants_lines]
        on_line = None
        if listeners:

            def on_line(rank: int, text: str) -> None:
                tell(listeners, "on_rank_line", rank, text)

        self.pump = self._pump_factory(self.stdout, self.stderr, self.opts.output, on_line)
        self.gang = self._gang_factory(spec, self.pump, events)
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
                    waited = self._restarts.back_off(
                        verdict.backoff, self._events, lambda: self._cancel_reason, self._started
                    )
                    if waited is None:
                        self.call.attempt += 1
                        self.rundir.clear_attempt()
                        self._launch_attempt()
                        continue
                    attempt = waited  # cancelled or out of time while waiting to restart
                annotate(attempt.error, self.outcome.attempts, self.opts.max_restarts)
                self._end(attempt)
                return
        except BaseException as exc:  # a bug in gangrun itself: the call still ends, cleanly
            log.exception("the monitor of call %s failed", self.run_id)
            self._end(exc)

    def _next_event(self, events: queue.Queue[QueueItem], wait: float | None) -> Event | None:
        try:
            item = events.get(timeout=wait)
        except queue.Empty:
            return None
        return RankExited(item) if isinstance(item, RankExit) else item  # type: ignore[no-any-return]

    def _watch_attempt(self) -> Attempt:
        assert self.plan is not None and self.rundir is not None and self.gang is not None
        gang, events, n = self.gang, self._events, self.plan.world_size
        assert events is not None
        timeout = self.opts.timeout
        deadline = None if timeout is None else self._started + timeout
        remaining = set(range(n))
        exits: dict[int, RankExit] = {}
        ending: Event | None = None
        guard = None
        if self.opts.hang_timeout is not None:
            from ..hang import HangGuard

            guard = HangGuard(self.rundir.path, self.rundir.logs, n, self.opts.hang_timeout)
        try:
            while remaining:
                if self._cancel_reason is not None:
                    ending = CancelRequested(self._cancel_reason)
                    break
                wait = None if deadline is None else deadline - time.monotonic()
                if wait is not None and wait <= 0:
                    ending = DeadlineReached(float(timeout or 0))
                    break
                if guard is not None:
                    wait = guard.poll_interval if wait is None else min(wait, guard.poll_interval)
                ev = self._next_event(events, wait)
                if ev is None:
                    stalled = guard.check(sorted(remaining)) if guard is not None else []
                    if guard is not None and stalled:
                        guard.dump_stacks(gang.pids, sorted(remaining))
                        ending = HangDetected(stalled)
                        break
                    continue
                if not isinstance(ev, RankExited):
                    ending = ev
                    break
                exits[ev.rank] = ev.exit
                tell(self.observers, "on_rank_exit", ev.rank, ev.exit.exitcode, False)
                remaining.discard(ev.rank)
                if self._files.exit_failed(ev.exit):
                    ending = ev
                    break
        finally:
            self._machine.to(State.STOPPING)
            teardown_at = time.time()
            self._close_gang(stop=bool(remaining), grace=None)
        while True:  # exits that arrived during the teardown
            late = self._next_event(events, 0)
            if late is None:
                break
            if isinstance(late, RankExited) and late.rank not in exits:
                exits[late.rank] = late.exit
                tell(self.observers, "on_rank_exit", late.rank, late.exit.exitcode, True)
        return self._attempt_result(ending, exits, teardown_at, guard)

    def _attempt_result(
        self,
        ending: Event | None,
        exits: dict[int, RankExit],
        teardown_at: float,
        guard: HangGuard | None,
    ) -> Attempt:
        number, n, name = self.call.attempt, self.world_size, self.fn_name
        if isinstance(ending, CancelRequested):
            err: DistributedError = DistributedCancelledError(
                f"{name} was {ending.reason}; all {n} ranks were stopped.", run_id=self.run_id
            )
            return Attempt(number, State.CANCELLED, err)
        if isinstance(ending, DeadlineReached):
            err = DistributedTimeoutError(
                f"{name} did not finish within timeout={ending.timeout:g}s; all {n} ranks "
                "were stopped.",
                run_id=self.run_id,
            )
            return Attempt(number, State.TIMED_OUT, err)
        if isinstance(ending, HangDetected):
            assert guard is not None  # only the guard detects hangs
            return Attempt(number, State.HUNG, guard.error(name, self.run_id, self.log_dir))
        assert self.gang is not None
        if isinstance(ending, RankExited):
            err = self._files.root_cause(exits, ending.exit, teardown_at, self.gang.pids)
            return Attempt(number, State.FAILED, err, dict(err.failures))
        try:
            self.outcome.results = self._files.collect()
        except DistributedError as exc:
            ended = State.CANCELLED if hasattr(exc, "resume") else State.FAILED  # preempted
            return Attempt(number, ended, exc, dict(exc.failures))
        return Attempt(number, State.SUCCEEDED)

    # ---------------------------------------------------------------- the one teardown
    def _close_gang(self, stop: bool, grace: float | None) -> None:
        gang, pump = self.gang, self.pump
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
            ("release the GPUs", self._release_gpus),
            ("settle the outcome", lambda: self._settle(state, error)),
        ]
        if self.rundir is not None:
            rd = self.rundir
            steps += [("remove the payload", lambda: _unlink(rd.payload))]
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

    def _notify(self, state: State, outcome: Outcome) -> None:
        notify(self.observers, state, outcome, self.call)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass  # never written (the start failed before the payload)


__all__ = ["Supervisor", "GangFactory", "Planner", "default_planner"]
