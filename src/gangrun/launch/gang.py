"""The one concrete `Gang`: rank processes of one attempt of one call,
whatever `Spawner` started them.

It owns what every launcher needs the same way (cf. torch elastic's ``PContext`` over its
per-process handlers): the rank log files, the wiring of each rank's stdout/stderr into the
output pump, the caller's liveness pipe, one blocking exit-waiter thread per rank that puts a
`RankExit` into the lifecycle's ``events`` queue the moment the rank
ends (no polling interval), stop (SIGTERM, grace, SIGKILL, then the ``GANGRUN_RUN_ID`` sweep)
and close.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from typing import IO, TYPE_CHECKING

from ..host import system as platform
from ..wire.rundir import RunDir, log_path
from ..wire.stop import mark_teardown
from . import ExitSink, GangSpec, LostRank, RankExit, RankIO, RankProcess, RankSpec, Spawner
from .limits import check_env
from .spawn import SpawnSpawner, close_fds

if TYPE_CHECKING:
    from ..output import OutputPump

log = logging.getLogger("gangrun.launch")
_START_METHODS = ("auto", "spawn", "forkserver")


def open_log(log_dir: str, rank: int) -> IO[bytes]:
    """Rank ``rank``'s log file (appended to across restarts; 0600; never through a symlink
    or into a file of another user: docs/security.md)."""
    from ..wire.security import open_log as open_private_log

    return open_private_log(log_path(log_dir, rank))


def start_method(spec: GangSpec) -> str:
    """The spec's start method (the call's option: ``GANGRUN_START_METHOD`` was read, once,
    as its default when the options were resolved; an explicit ``"auto"`` wins over it)."""
    method = spec.start_method
    return method if method in _START_METHODS else "auto"


def choose_spawner(spec: GangSpec) -> Spawner:
    """Ray when the spec carries a placement; else the fork server where usable (``auto``)
    or asked for, falling back to fresh interpreters, once, here, when it cannot start.
    An environment the kernel would not start a process with is refused first."""
    check_env(spec.ranks)
    if spec.placement is not None:
        from .ray.spawner import RaySpawner

        log.debug("call %s: spawner: Ray actors (backend='ray')", spec.run_id)
        return RaySpawner(spec)
    method = start_method(spec)
    if method == "spawn":
        log.debug("call %s: spawner: fresh interpreters (start_method='spawn')", spec.run_id)
        return SpawnSpawner()
    from .forkserver import client
    from .forkserver.spawner import ForkServerSpawner

    wait = client.registry.retry_in()
    if method == "auto" and not (client.usable() and wait <= 0):
        why = f"failed to start: retried in {wait:.0f}s" if wait > 0 else "not usable here"
        log.debug("call %s: spawner: fresh interpreters (fork server %s)", spec.run_id, why)
        return SpawnSpawner()
    try:
        sp = ForkServerSpawner.lease(spec)
        log.debug("call %s: spawner: warm fork server (start_method=%r)", spec.run_id, method)
        return sp
    except Exception as exc:
        print(
            f"gangrun: the fork server is unavailable ({type(exc).__name__}: {exc}); "
            "starting fresh interpreters instead (start_method='spawn').",
            file=sys.stderr,
        )
        return SpawnSpawner()


def _mark_teardown(run_dir: str) -> None:
    """Tell ranks that handle SIGTERM (a `gangrun.Checkpointer` is active) that this
    SIGTERM is the teardown, not a preemption: they die at once (rank/stop.py)."""
    if not run_dir:
        return
    try:
        mark_teardown(RunDir(run_dir))
    except OSError:  # the run directory is gone: no rank can be reading it either
        pass


class ProcessGang:
    """The rank processes of one attempt of one call."""

    def __init__(
        self, spec: GangSpec, pump: OutputPump, events: ExitSink, spawner: Spawner
    ) -> None:
        self.spec = spec
        self.pump = pump
        self.events = events
        self.spawner = spawner
        self.pids: dict[int, int] = {}
        self._procs: dict[int, RankProcess] = {}
        self._done: dict[int, threading.Event] = {}
        self._waiters: list[threading.Thread] = []
        self._logs: list[IO[bytes]] = []
        self._live_w = -1
        self._since_ticks = platform.ticks_now()
        self._released = False
        platform.forget_in_forked_child(self)

    # -- start ------------------------------------------------------------------------
    def start(self) -> None:
        spec = self.spec
        live_r, self._live_w = os.pipe()
        reads: list[tuple[RankSpec, int, int]] = []
        todo: list[tuple[RankSpec, RankIO]] = []
        try:
            for r in spec.ranks:
                out_r, out_w = os.pipe()
                err_r, err_w = os.pipe()
                reads.append((r, out_r, err_r))
                todo.append((r, RankIO(out_w, err_w, live_r)))
            for r, out_r, err_r in reads:  # the pump owns the read ends from here on
                logf = open_log(spec.log_dir, r.rank)
                self._logs.append(logf)
                self.pump.add(r.rank, "out", out_r, logf)
                self.pump.add(r.rank, "err", err_r, logf)
            reads.clear()
            procs = self.spawner.start(spec, todo)
            for (r, _), proc in zip(todo, procs, strict=True):
                self._watch(r.rank, proc)
        except BaseException:
            for _, out_r, err_r in reads:
                close_fds([out_r, err_r])
            for _, io in todo:  # the spawner closes them; not if it was never reached
                close_fds([io.out_w, io.err_w])
                io.out_w = io.err_w = -1
            self.spawner.release(0.0)
            self._released = True
            raise
        finally:
            os.close(live_r)
        self.pump.start()

    def _watch(self, rank: int, proc: RankProcess) -> None:
        self._procs[rank] = proc
        self.pids[rank] = proc.pid
        self._done[rank] = threading.Event()
        t = threading.Thread(
            target=self._wait, args=(rank, proc), name=f"gangrun-wait-{rank}", daemon=True
        )
        t.start()
        self._waiters.append(t)

    def _wait(self, rank: int, proc: RankProcess) -> None:
        lost: LostRank | None
        node = proc.node
        try:
            code = proc.wait()
            lost = proc.lost
        except BaseException as exc:  # a bug in a spawner must still end the rank's wait
            log.exception("waiting for rank %d failed", rank)
            code = -signal.SIGKILL
            lost = LostRank(
                f"waiting for rank {rank} failed ({type(exc).__name__}: {exc})",
                hint="This is a bug in gangrun: please report it with the log above.",
            )
        self._done[rank].set()
        self.events.put(RankExit(rank, code, time.time(), lost, node))

    # -- state and teardown -----------------------------------------------------------
    def alive(self) -> list[int]:
        return [r for r, ev in self._done.items() if not ev.is_set()]

    def signal_rank(self, rank: int, sig: int) -> None:
        """Send ``sig`` to one rank's tree, wherever it runs (an interactive gang's
        interrupt, or its stack request)."""
        proc = self._procs.get(rank)
        if proc is not None:
            proc.signal(sig)

    def nodes_elsewhere(self) -> dict[int, str]:
        """The ranks on another node than the caller's, and their node as errors name it
        (Ray; ``{}`` on one node)."""
        return dict(self.spawner.nodes_elsewhere())

    def _signal_all(self, sig: int) -> None:
        for proc in self._procs.values():  # finished ranks too: their leftover descendants
            proc.signal(sig)

    def _wait_all(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        return all(ev.wait(max(0.0, deadline - time.monotonic())) for ev in self._done.values())

    def stop(self, grace: float | None = None) -> None:
        """SIGTERM every rank's tree, wait up to ``grace``, SIGKILL what is left, sweep."""
        grace = self.spec.grace_period if grace is None else grace
        if self.alive():
            _mark_teardown(self.spec.run_dir)
            self._signal_all(signal.SIGTERM)
            self._wait_all(grace)
        self.reap_leftovers()

    def reap_leftovers(self) -> None:
        """Kill whatever is left of the ranks' trees (descendants included)."""
        self._signal_all(signal.SIGKILL)
        self._wait_all(5.0)
        platform.sweep(self.spec.run_id, self._since_ticks)

    def close(self) -> None:
        """Release the liveness pipe, the waiter threads, the log files and what the spawner
        holds for this gang (after the ranks are gone)."""
        if self._live_w != -1:
            os.close(self._live_w)
            self._live_w = -1
        for t in self._waiters:
            t.join(1.0)
        if not self._released:
            self._released = True
            self.spawner.release(0.0)
        for f in self._logs:
            try:
                f.close()
            except OSError as exc:  # a full disk: nothing more to write anyway
                log.debug("closing a rank log failed: %s", exc)
        self._logs.clear()

    def after_fork_in_child(self) -> None:
        # A child forked from the caller must not keep the caller's ranks alive: the ranks
        # watch the liveness pipe's write end, which only the caller may hold.
        if self._live_w != -1:
            os.close(self._live_w)
            self._live_w = -1
        self._released = True  # the lease (fork server, Ray) is the parent's
