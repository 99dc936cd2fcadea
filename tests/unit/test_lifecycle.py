"""The call's lifecycle with a fake gang: no processes, no MLflow (together well under 5 s).

The fake gang (``tests/fakes.py``) plays a script of rank exits and the files ranks would
leave (results, error records); the real supervisor, policy, root-cause selection and outcome record run on it.
"""

from __future__ import annotations

import os
import pickle
import signal
import time

import pytest

from fakes import FakeGang, both_return, call, supervisor
from gangrun.api import Options
from gangrun.errors import (
    DistributedCancelledError,
    DistributedError,
    DistributedHangError,
    DistributedTimeoutError,
    LaunchError,
)
from gangrun.lifecycle.observers import CallView, Observer
from gangrun.lifecycle.policy import Decision, RestartPolicy
from gangrun.lifecycle.state import IllegalTransition, Outcome, State, StateMachine


class Recorder(Observer):
    def __init__(self) -> None:
        self.states: list[State] = []

    def on_transition(self, state: State, run: CallView) -> None:
        self.states.append(state)


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

    sup = supervisor(o, factory)
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
        from gangrun.wire import collectives

        # rank 0 waits in an all_reduce that rank 1 never enters (and rank 1 shows nothing)
        ring = collectives.Ring.open(collectives.path(g.spec.run_dir, 0), 0)
        entered = time.time() - 10
        ring.enter(collectives.OpRecord("all_reduce", "world", 1, -1, 4, "", "t.py:3", entered, 0))

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
    sup = supervisor(o, lambda s, p, e: made.append(FakeGang(s, e, boom, 0)) or made[-1])
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
