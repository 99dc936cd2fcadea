"""The call's lifecycle with a fake gang: no processes, no MLflow (together well under 5 s).

The fake gang plays a script of rank exits and the files ranks would leave (results, error
records); the real supervisor, policy, root-cause selection and outcome record run on it.
"""

from __future__ import annotations

import io
import os
import pickle
import queue
import signal
import time
from collections.abc import Callable
from dataclasses import replace

import pytest

from gangrun import serialization
from gangrun.api import Options
from gangrun.errors import (
    DistributedCancelledError,
    DistributedError,
    DistributedHangError,
    DistributedTimeoutError,
    LaunchError,
)
from gangrun.launch import GangSpec, RankExit
from gangrun.lifecycle.observers import CallView, Observer
from gangrun.lifecycle.plan import Plan
from gangrun.lifecycle.policy import Decision, RestartPolicy
from gangrun.lifecycle.state import IllegalTransition, Outcome, State, StateMachine
from gangrun.lifecycle.supervisor import Supervisor
from gangrun.records import ErrorRecord

Script = Callable[["FakeGang"], None]


class FakePump:
    def close(self, drain_timeout: float = 0.0) -> None:
        pass


class FakeGang:
    """Ranks that do what the script says; stop() 'kills' the ranks still running."""

    def __init__(self, spec: GangSpec, events: queue.Queue, script: Script, attempt: int):
        self.spec, self.events, self.script, self.attempt = spec, events, script, attempt
        self.pids = {r.rank: 10_000_000 + r.rank for r in spec.ranks}  # never real pids
        self.exited: set[int] = set()
        self.stopped = self.closed = False

    def start(self) -> None:
        self.script(self)

    def alive(self) -> list[int]:
        return [r for r in self.pids if r not in self.exited]

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


class Recorder(Observer):
    def __init__(self) -> None:
        self.states: list[State] = []

    def on_transition(self, state: State, run: CallView) -> None:
        self.states.append(state)


def fn() -> None:
    pass


def call(*scripts: Script, n: int = 2, observers=None, **opts) -> Supervisor:
    """Start a supervised call whose attempt i plays scripts[i]."""
    opts.setdefault("processes", n)
    opts.setdefault("mlflow", False)
    opts.setdefault("grace_period", 0.1)
    opts.setdefault("restart_backoff", 0.0)
    o = Options(**opts).validate()
    attempts: list[FakeGang] = []

    def factory(spec: GangSpec, pump: object, events: queue.Queue) -> FakeGang:
        g = FakeGang(spec, events, scripts[min(len(attempts), len(scripts) - 1)], len(attempts))
        attempts.append(g)
        return g

    sup = Supervisor(
        fn,
        (),
        {},
        o,
        stdout=io.StringIO(),
        stderr=io.StringIO(),
        gang_factory=factory,  # type: ignore[arg-type]
        planner=lambda f, opts: (Plan(n), None),
        pump_factory=lambda *a: FakePump(),
        observers=observers or (),
    )
    sup.gangs = attempts  # type: ignore[attr-defined]
    sup.start()
    assert sup.wait(10), "the call did not end"
    return sup


def both_return(g: FakeGang) -> None:
    g.ret(0, "a")
    g.ret(1, "b")


def test_success_outcome_and_transitions():
    rec = Recorder()
    sup = call(both_return, observers=[rec])
    assert sup.result() == ["a", "b"]
    out = sup.outcome
    assert out.state is State.SUCCEEDED and out.mlflow_status == "FINISHED"
    assert rec.states == [State.LAUNCHING, State.RUNNING, State.STOPPING, State.SUCCEEDED]
    assert len(out.attempts) == 1 and out.failures == {}


def test_root_cause_prefers_own_failure_over_peer_echo_and_keeps_every_failure():
    def script(g: FakeGang) -> None:
        t = time.time()
        g.fail(1, "Connection reset by peer", at=t - 1)  # echo, earlier by the clock
        g.exit(0, -signal.SIGKILL, at=t)  # the real cause, seen later, no record

    sup = call(script)
    err = sup.outcome.error
    assert isinstance(err, DistributedError) and err.rank == 0 and err.signal == "SIGKILL"
    assert str(err).startswith("Rank 0 (pid 10000000) was killed by SIGKILL")
    assert sorted(err.failures) == [0, 1]
    assert err.failures[1].exc_type == "ValueError" and err.failures[0].signal == "SIGKILL"
    assert sup.outcome.failures == err.failures
    e2 = pickle.loads(pickle.dumps(err))
    assert e2.failures == err.failures and e2.rank == 0


def test_error_record_is_authoritative_over_exit_status():
    sup = call(lambda g: (g.ret(0, 0), g.fail(1, "boom", code=0)))  # SIGCHLD ignored: 0
    err = sup.outcome.error
    assert isinstance(err, DistributedError) and err.rank == 1 and err.exitcode == 1
    assert "ValueError: boom" in str(err).splitlines()[0]


def test_exit_zero_without_result_or_record_is_a_failure():
    sup = call(lambda g: g.exit(1, 0))
    err = sup.outcome.error
    assert isinstance(err, DistributedError) and err.rank == 1 and err.exitcode == 0
    assert "exited with code 0 before returning" in str(err)
    assert sup.outcome.state is State.FAILED and sup.gangs[0].stopped


def test_clean_sys_exit_everywhere_is_success_but_early_exit_is_the_root_cause():
    both = call(lambda g: (g.fail(0, "", code=0, exc="SystemExit"), g.ret(1, 1)))
    assert both.result() == [None, 1]

    def early(g: FakeGang) -> None:
        t = time.time()
        g.fail(1, "", code=0, exc="SystemExit", at=t - 1)
        g.fail(0, "Connection reset by peer", at=t)

    err = call(early).outcome.error
    assert isinstance(err, DistributedError) and err.rank == 1
    assert "exited with code 0 before returning" in str(err).splitlines()[0]
    assert sorted(err.failures) == [0, 1]


def test_restart_then_success_prints_a_notice():
    sup = call(lambda g: (g.step(1, 3), g.fail(1, "flaky")), both_return, max_restarts=2)
    assert sup.result() == ["a", "b"]
    states = [a.state for a in sup.outcome.attempts]
    assert states == [State.FAILED, State.SUCCEEDED]
    assert sup.outcome.attempts[0].failures[1].message == "flaky"
    assert "Restarting the gang (restart 1/2)" in sup.call.stderr.getvalue()  # type: ignore[attr-defined]


def test_restarts_exhausted():
    sup = call(lambda g: (g.step(0, 3), g.fail(0, "always")), max_restarts=1)
    assert sup.outcome.state is State.FAILED and len(sup.outcome.attempts) == 2
    assert sup.outcome.mlflow_status == "FAILED"


def test_timeout_never_restarts():
    sup = call(lambda g: None, timeout=0.2, max_restarts=3)
    assert isinstance(sup.outcome.error, DistributedTimeoutError)
    assert sup.outcome.state is State.TIMED_OUT and sup.outcome.mlflow_status == "KILLED"
    assert len(sup.outcome.attempts) == 1 and sup.gangs[0].stopped


def test_cancel_travels_as_an_event():
    o = Options(processes=2, mlflow=False, timeout=None, max_restarts=2).validate()
    gangs: list[FakeGang] = []

    def factory(spec, pump, events):
        gangs.append(FakeGang(spec, events, lambda g: None, 0))
        return gangs[-1]

    sup = Supervisor(
        fn, (), {}, o, stderr=io.StringIO(), gang_factory=factory,
        planner=lambda f, opts: (Plan(2), None),
        pump_factory=lambda *a: FakePump(),
    )  # fmt: skip
    sup.start()
    assert sup.cancel("cancelled", wait=5)
    assert isinstance(sup.outcome.error, DistributedCancelledError)
    assert sup.outcome.state is State.CANCELLED and sup.outcome.mlflow_status == "KILLED"
    assert len(gangs) == 1 and gangs[0].stopped and gangs[0].closed
    assert not sup.cancel()  # already over


def test_hang_detected_and_retried(monkeypatch):
    from gangrun.lifecycle import hang

    monkeypatch.setattr(hang.HangGuard, "dump_stacks", lambda self, pids, live, wait=2.0: None)

    def silent(g: FakeGang) -> None:
        for r in g.pids:  # booted (heartbeat file) and then silent
            open(os.path.join(g.spec.run_dir, f"heartbeat.{r}"), "w").close()

    sup = call(silent, both_return, hang_timeout=0.2, max_restarts=1)
    assert [a.state for a in sup.outcome.attempts] == [State.HUNG, State.SUCCEEDED]
    assert isinstance(sup.outcome.attempts[0].error, DistributedHangError)
    sup = call(silent, hang_timeout=0.2)
    assert sup.outcome.state is State.HUNG and sup.outcome.mlflow_status == "FAILED"


def test_launch_failure_releases_everything():
    def boom(g: FakeGang) -> None:
        raise LaunchError("cannot start")

    o = Options(processes=2, mlflow=False).validate()
    made: list[FakeGang] = []
    sup = Supervisor(
        fn, (), {}, o, stderr=io.StringIO(),
        gang_factory=lambda s, p, e: made.append(FakeGang(s, e, boom, 0)) or made[-1],
        planner=lambda f, opts: (Plan(2), None),
        pump_factory=lambda *a: FakePump(),
    )  # fmt: skip
    with pytest.raises(LaunchError):
        sup.start()
    assert sup.done() and sup.outcome.state is State.FAILED
    assert made[0].stopped and made[0].closed
    assert not os.path.exists(sup.run_dir)


def test_observer_that_raises_does_not_change_the_outcome():
    class Broken(Observer):
        def on_transition(self, state, run):
            raise RuntimeError("observer bug")

    assert call(both_return, observers=[Broken()]).result() == ["a", "b"]


def test_illegal_transitions_raise():
    m = StateMachine(Outcome())
    with pytest.raises(IllegalTransition):
        m.to(State.SUCCEEDED)  # planning -> succeeded skips the launch
    m.to(State.LAUNCHING)
    m.to(State.RUNNING)
    with pytest.raises(IllegalTransition):
        m.to(State.RESTARTING)  # only after stopping
    m.to(State.STOPPING)
    m.to(State.CANCELLED)
    for s in State:
        with pytest.raises(IllegalTransition):
            m.to(s)  # terminal


def test_policy_decisions():
    p = RestartPolicy(max_restarts=1)
    assert p.decide(State.FAILED, 0) is Decision.RESTART
    assert p.decide(State.HUNG, 0) is Decision.RESTART
    assert p.decide(State.FAILED, 1) is Decision.STOP
    for s in (State.TIMED_OUT, State.CANCELLED, State.SUCCEEDED):
        assert p.decide(s, 0) is Decision.STOP
    assert RestartPolicy(0).decide(State.FAILED, 0) is Decision.STOP
