"""Process-free stand-ins for gangrun's launch seams, shared by the unit tests.

Each fake plays one protocol of `gangrun.launch` (or the fork-server client) so that the real
code above it runs unchanged, in milliseconds, with nothing started:

- `FakeSpawner` / `FakeRank`: a `Spawner` whose `RankProcess`es are no processes. Under a
  real `ProcessGang` they exercise its stop logic: SIGTERM, the grace period, SIGKILL of what
  is left, the ``GANGRUN_RUN_ID`` sweep, and what it releases and closes. `fake_process_gang`
  builds one.
- `FakeGang` (with `FakePump`): a whole `Gang` that plays a script of rank exits and the files
  ranks would leave (results, error records, step reports), under the real `Supervisor`,
  restart policy and outcome record; `call` starts a supervised call on it.
- `FakeServer`: a fork server for `gangrun.launch.forkserver.client.Registry`.

A `Supervisor` made here (or given to `track`) is released after the test, as a dropped
handle would be: its run directory is real.

Hardware we lack (NVML, GPU names) is mocked where it is used, not here.
"""

from __future__ import annotations

import io
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from gangrun.launch import GangSpec, RankExit, RankIO, RankSpec
from gangrun.launch.gang import ProcessGang
from gangrun.lifecycle.plan import Plan
from gangrun.lifecycle.supervisor import Supervisor
from gangrun.options import Options
from gangrun.wire import serialization
from gangrun.wire.records import ErrorRecord

FAKE_PID = 10_000_000  # above any real pid (pid_max is at most 2**22): never signals a process


# ---------------------------------------------------------------------- spawner and ranks
class FakeRank:
    """A started rank that is no process. It ends when the test says so (`end`), or on a
    signal it does not survive: SIGKILL always, SIGTERM unless ``survives_term``.
    ``log`` (shared with its spawner) records ``("signal", rank, sig)`` in arrival order."""

    def __init__(
        self,
        rank: int,
        log: list[tuple],
        *,
        survives_term: bool = False,
        lost: str | None = None,
        wait_error: BaseException | None = None,
    ) -> None:
        self.rank = rank
        self.pid = FAKE_PID + rank
        self.lost = lost  # what `RankExit.lost` carries (a launcher that lost the rank)
        self.node: str | None = None  # on the caller's node
        self.signals: list[int] = []
        self.code: int | None = None
        self._log = log
        self._survives_term = survives_term
        self._wait_error = wait_error
        self._ended = threading.Event()

    def end(self, code: int) -> None:
        """The rank exits with ``code`` (first exit wins, as for a process)."""
        if self.code is None:
            self.code = code
            self._ended.set()

    def wait(self, timeout: float = 30.0) -> int:
        if self._wait_error is not None:
            raise self._wait_error
        # bounded: a test that forgets a rank must not leave the waiter thread forever
        if not self._ended.wait(timeout):
            raise AssertionError(f"fake rank {self.rank} was never ended")
        assert self.code is not None
        return self.code

    def signal(self, sig: int) -> None:
        self.signals.append(sig)
        self._log.append(("signal", self.rank, sig))
        if sig == signal.SIGKILL or (sig == signal.SIGTERM and not self._survives_term):
            self.end(-sig)


class FakeSpawner:
    """A `Spawner` of `FakeRank`s. ``survives_term``: the ranks that ignore SIGTERM;
    ``lost``/``wait_errors``: per rank, see `FakeRank`; ``fail``: `start` raises it (after
    closing the pipes it was handed, as a real spawner does)."""

    name = "fake"
    lost_nodes: frozenset[str] = frozenset()

    def nodes_elsewhere(self) -> dict[int, str]:
        return {}

    def __init__(
        self,
        *,
        survives_term: Sequence[int] = (),
        lost: dict[int, str] | None = None,
        wait_errors: dict[int, BaseException] | None = None,
        fail: BaseException | None = None,
    ) -> None:
        self.survives_term = set(survives_term)
        self.lost = dict(lost or {})
        self.wait_errors = dict(wait_errors or {})
        self.fail = fail
        self.log: list[tuple] = []  # ("signal", rank, sig), ("release", grace), ("sweep", id)
        self.ranks: dict[int, FakeRank] = {}
        self.released: list[float] = []

    def start(self, spec: GangSpec, ranks: Sequence[tuple[RankSpec, RankIO]]) -> list[FakeRank]:
        for _, rio in ranks:  # the spawner owns the write ends from here on
            for fd in (rio.out_w, rio.err_w):
                if fd != -1:
                    os.close(fd)
            rio.out_w = rio.err_w = -1
        if self.fail is not None:
            raise self.fail
        out = []
        for r, _ in ranks:
            out.append(
                FakeRank(
                    r.rank,
                    self.log,
                    survives_term=r.rank in self.survives_term,
                    lost=self.lost.get(r.rank),
                    wait_error=self.wait_errors.get(r.rank),
                )
            )
            self.ranks[r.rank] = out[-1]
        return out

    def release(self, grace: float) -> None:
        self.released.append(grace)
        self.log.append(("release", grace))


class FakePump:
    """An `OutputPump` that reads nothing: it only owns (and at `close` closes) the read ends
    of the ranks' pipes."""

    def __init__(self) -> None:
        self.fds: list[tuple[int, str, int]] = []
        self.started = self.closed = False

    def add(self, rank: int, kind: str, fd: int, log: object) -> None:
        self.fds.append((rank, kind, fd))

    def start(self) -> None:
        self.started = True

    def close(self, drain_timeout: float = 0.0) -> None:
        if not self.closed:
            self.closed = True
            for _, _, fd in self.fds:
                os.close(fd)


@dataclass
class FakeProcessGang:
    """A real `ProcessGang` over a `FakeSpawner`, with what a test looks at."""

    gang: ProcessGang
    spawner: FakeSpawner
    pump: FakePump
    events: queue.Queue
    spec: GangSpec
    exits: dict[int, RankExit] = field(default_factory=dict)

    def collect(self, n: int | None = None, timeout: float = 10.0) -> dict[int, RankExit]:
        """Wait (bounded) until ``n`` ranks (default: all) have reported their exit."""
        want = len(self.spec.ranks) if n is None else n
        deadline = time.monotonic() + timeout
        while len(self.exits) < want:
            left = deadline - time.monotonic()
            assert left > 0, f"only {sorted(self.exits)} of {want} ranks reported an exit"
            ex = self.events.get(timeout=left)
            self.exits[ex.rank] = ex
        return self.exits

    def close(self) -> None:
        self.gang.close()
        self.pump.close()


def fake_process_gang(
    tmp_path: Path, spawner: FakeSpawner, n: int = 2, grace: float = 0.2, start: bool = True
) -> FakeProcessGang:
    """A `ProcessGang` of ``n`` fake ranks, started unless ``start=False`` (run directory and
    logs under ``tmp_path``)."""
    run_dir, log_dir = tmp_path / "run", tmp_path / "logs"
    run_dir.mkdir(exist_ok=True)
    log_dir.mkdir(exist_ok=True)
    spec = GangSpec(
        run_id=f"fake-{time.time_ns()}",
        run_dir=str(run_dir),
        ranks=[RankSpec(r, {}) for r in range(n)],
        log_dir=str(log_dir),
        grace_period=grace,
    )
    pump, events = FakePump(), queue.Queue[RankExit]()
    gang = ProcessGang(spec, pump, events, spawner)  # type: ignore[arg-type]
    if start:
        gang.start()
    return FakeProcessGang(gang, spawner, pump, events, spec)


# ------------------------------------------------------------------------- a whole gang
Script = Callable[["FakeGang"], None]


class FakeGang:
    """Ranks that do what the script says; stop() 'kills' the ranks still running."""

    def __init__(self, spec: GangSpec, events: queue.Queue, script: Script, attempt: int):
        self.spec, self.events, self.script, self.attempt = spec, events, script, attempt
        self.spawner = FakeSpawner()  # what the DEBUG narration names
        self.pids = {r.rank: FAKE_PID + r.rank for r in spec.ranks}  # never real pids
        self.exited: set[int] = set()
        self.stopped = self.closed = False

    def start(self) -> None:
        self.script(self)

    def nodes_elsewhere(self) -> dict[int, str]:
        return {}

    def alive(self) -> list[int]:
        return [r for r in self.pids if r not in self.exited]

    def signal_rank(self, rank: int, sig: int) -> None:
        pass

    def stop(self, grace: float | None = None) -> None:
        self.stopped = True
        for r in self.alive():
            self.exit(r, -signal.SIGTERM)

    def reap_leftovers(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True

    # what a rank does
    def exit(self, rank: int, code: int, at: float | None = None) -> None:
        self.exited.add(rank)
        self.events.put(RankExit(rank, code, time.time() if at is None else at))

    def ret(self, rank: int, value: object) -> None:
        serialization.atomic_dump(value, os.path.join(self.spec.run_dir, f"result.{rank}.pkl"))
        self.exit(rank, 0)

    def step(self, rank: int, step: int, resumed: int = -1) -> None:
        """What ``gangrun.report_step`` (and ``report_resumed``) leave: ``progress.<rank>``."""
        now = time.time()
        line = f"{step} -1 {resumed} {step} {now:.6f} {now:.6f}".ljust(95) + "\n"
        with open(os.path.join(self.spec.run_dir, f"progress.{rank}"), "w") as f:
            f.write(line)

    def fail(
        self,
        rank: int,
        msg: str,
        *,
        code: int = 1,
        exc: str = "ValueError",
        at: float = 0.0,
        frame: str | None = None,
    ) -> None:
        rec = ErrorRecord(
            rank, exc, msg, f"Traceback...\n{exc}: {msg}\n", at or time.time(), frame=frame
        )
        if exc == "SystemExit":
            rec = replace(rec, exitcode=code)
        serialization.atomic_dump(rec, os.path.join(self.spec.run_dir, f"error.{rank}.pkl"))
        self.exit(rank, code)


def both_return(g: FakeGang) -> None:
    g.ret(0, "a")
    g.ret(1, "b")


def fn() -> None:
    pass


MADE: list[Supervisor] = []  # the supervisors of the running test (their run directories)


def track(sup: Supervisor) -> Supervisor:
    """Release ``sup`` after the test (`release_all`), as a dropped handle would: its run
    directory is real and goes only then."""
    MADE.append(sup)
    return sup


def release_all() -> None:
    """Release every supervisor the test made (conftest calls it after each test)."""
    while MADE:
        MADE.pop().release()


def supervisor(
    options: Options,
    gang_factory: Callable[[GangSpec, object, queue.Queue], FakeGang],
    *,
    n: int = 2,
    observers=None,
) -> Supervisor:
    """A real `Supervisor` (not started) whose gangs come from ``gang_factory``: no planner,
    no output pump, no processes."""
    return track(
        Supervisor(
            fn,
            (),
            {},
            options,
            stdout=io.StringIO(),
            stderr=io.StringIO(),
            gang_factory=gang_factory,  # type: ignore[arg-type]
            planner=lambda f, opts: (Plan(n), None),
            pump_factory=lambda *a: FakePump(),  # type: ignore[arg-type,return-value]
            observers=observers or (),
        )
    )


def call(*scripts: Script, n: int = 2, observers=None, **opts) -> Supervisor:
    """Start a supervised call (no MLflow) whose attempt i plays scripts[i] (the last one
    again for later attempts), and wait (bounded) for its end; ``sup.gangs`` holds the
    `FakeGang` of each attempt."""
    opts.setdefault("processes", n)
    opts.setdefault("mlflow", False)  # Options() directly: no GANGRUN_* default applies
    opts.setdefault("grace_period", 0.1)
    opts.setdefault("restart_backoff", 0.0)
    attempts: list[FakeGang] = []

    def factory(spec: GangSpec, pump: object, events: queue.Queue) -> FakeGang:
        g = FakeGang(spec, events, scripts[min(len(attempts), len(scripts) - 1)], len(attempts))
        attempts.append(g)
        return g

    sup = supervisor(Options(**opts).validate(), factory, n=n, observers=observers)
    sup.gangs = attempts  # type: ignore[attr-defined]
    sup.start()
    assert sup.wait(10), "the call did not end"
    return sup


# --------------------------------------------------------------------------- fork server
class FakeServer:
    """A fork server for the client's `Registry`: alive until closed or marked dead."""

    def __init__(self, preload, env_sig, pool, start_timeout=None) -> None:
        self.env_sig = env_sig
        self.closed = False
        self.dead = False

    def alive(self) -> bool:
        return not (self.closed or self.dead)

    def close(self, wait: float = 2.0) -> None:
        self.closed = True

    def forget(self) -> None:
        self.closed = True


__all__ = [
    "FAKE_PID",
    "FakeGang",
    "FakeProcessGang",
    "FakePump",
    "FakeRank",
    "FakeServer",
    "FakeSpawner",
    "Script",
    "both_return",
    "call",
    "fake_process_gang",
    "supervisor",
]
