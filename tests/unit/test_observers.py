"""The one observer protocol: typed hooks called directly, every observer given at
construction, MLflow an acquisition of the call (so ``observers=`` never turns it off).

A fake gang and a fake MLflow run (no processes, no store): the real supervisor runs on them.
"""

from __future__ import annotations

import io
import logging
import os
import queue
from dataclasses import FrozenInstanceError

import pytest

from fakes import FakeGang, FakePump, both_return, call, fn, track
from gangrun.api import Options
from gangrun.errors import DistributedError, LaunchError
from gangrun.launch import GangSpec
from gangrun.lifecycle.observers import CallView, Observer, Observers
from gangrun.lifecycle.plan import Plan
from gangrun.lifecycle.state import State
from gangrun.lifecycle.supervisor import Supervisor


class Seen(Observer):
    """Every event, in order, as the observer was told it."""

    def __init__(self) -> None:
        self.events: list[tuple] = []

    def on_plan(self, run: CallView) -> None:
        self.events.append(("plan", run.call.run_id, run.call.world_size))

    def on_transition(self, state: State, run: CallView) -> None:
        self.events.append(("state", state))

    def on_rank_exit(self, rank: int, exitcode: int, stopped: bool) -> None:
        self.events.append(("exit", rank, exitcode, stopped))

    def on_rank_line(self, rank: int, text: str) -> None:
        self.events.append(("line", rank, text))


class Broken(Observer):
    """Raises in every hook."""

    def on_plan(self, run: CallView) -> None:
        raise RuntimeError("bug in on_plan")

    def on_transition(self, state: State, run: CallView) -> None:
        raise RuntimeError(f"bug in on_transition {state.value}")

    def on_rank_exit(self, rank: int, exitcode: int, stopped: bool) -> None:
        raise RuntimeError("bug in on_rank_exit")

    def on_rank_line(self, rank: int, text: str) -> None:
        raise RuntimeError("bug in on_rank_line")


class FakeTracker:
    """What the supervisor and its MLflow observer use of ``tracking.Tracker``."""

    run_id = "m" * 32
    tracking_uri = "sqlite:////nowhere.db"
    experiment_id = "0"
    resume_number = 0

    def __init__(self) -> None:
        self.finished: list[tuple] = []

    def rank_env(self) -> dict[str, str]:
        return {"MLFLOW_RUN_ID": self.run_id}

    def finish(self, status: str, error: BaseException | None, logs: dict[int, str]) -> None:
        self.finished.append((status, error, sorted(logs)))


def _supervised(script, *observers: Observer, tracking=None, lines=(), **opts) -> Supervisor:
    """A call on the fake gang whose pump reports ``lines`` (rank, text) as it starts."""
    o = Options(processes=2, mlflow=tracking is not None, grace_period=0.1, **opts).validate()
    gangs: list[FakeGang] = []

    def factory(spec: GangSpec, pump: object, events: queue.Queue) -> FakeGang:
        gangs.append(FakeGang(spec, events, script, len(gangs)))
        return gangs[-1]

    def pump_factory(stdout, stderr, mode, on_line=None, *named):
        for rank, text in lines:
            if on_line is not None:
                on_line(rank, text)
        return FakePump()

    sup = Supervisor(
        fn, (), {}, o, stdout=io.StringIO(), stderr=io.StringIO(),
        gang_factory=factory,  # type: ignore[arg-type]
        planner=lambda f, opts: (Plan(2), None),
        pump_factory=pump_factory,
        tracking=lambda info, out: tracking,  # called only with mlflow=True
        observers=list(observers),
    )  # fmt: skip
    sup.gangs = gangs  # type: ignore[attr-defined]
    return track(sup)


def test_every_hook_is_called_directly_in_order():
    seen = Seen()
    sup = _supervised(both_return, seen, lines=[(0, "hello"), (1, "world")])
    sup.start()
    assert sup.wait(10) and sup.result() == ["a", "b"]
    ev = seen.events
    assert ev[0] == ("plan", sup.call.run_id, 2)  # before anything is acquired
    assert ("line", 0, "hello") in ev and ("line", 1, "world") in ev
    assert ("exit", 0, 0, False) in ev and ("exit", 1, 0, False) in ev
    states = [e[1] for e in ev if e[0] == "state"]
    assert states == [State.LAUNCHING, State.RUNNING, State.STOPPING, State.SUCCEEDED]


def test_an_observer_that_raises_is_logged_and_changes_nothing(caplog):
    """Broken in every hook, first in the list: the call ends as it would have, the observer
    after it is told everything, and each failure is logged with its hook."""
    seen = Seen()
    with caplog.at_level(logging.ERROR, logger="gangrun.lifecycle.observers"):
        sup = _supervised(both_return, Broken(), seen, lines=[(0, "x")])
        sup.start()
        assert sup.wait(10) and sup.result() == ["a", "b"]
    assert sup.outcome.state is State.SUCCEEDED and sup.outcome.error is None
    assert [e[0] for e in seen.events].count("state") == 4 and ("line", 0, "x") in seen.events
    logged = caplog.text
    for hook in ("on_plan", "on_rank_line", "on_rank_exit", "on_transition(succeeded)"):
        assert f"failed in {hook}" in logged, hook

    def fails(g: FakeGang) -> None:
        g.ret(0, "a")
        g.fail(1, "boom")

    failing = _supervised(fails, Broken())
    failing.start()
    assert failing.wait(10)
    err = failing.outcome.error
    assert isinstance(err, DistributedError) and err.rank == 1 and "boom" in str(err)
    assert failing.outcome.state is State.FAILED


def test_observers_given_keep_mlflow_and_the_built_in_ones():
    """``observers=`` adds to the built-in observers: the MLflow run is still created (an
    acquisition), its variables reach the ranks, and it is ended with the outcome."""
    tracker, seen = FakeTracker(), Seen()
    sup = _supervised(both_return, seen, tracking=tracker)
    sup.start()
    assert sup.wait(10) and sup.result() == ["a", "b"]
    assert sup.mlflow_run_id == tracker.run_id
    assert sup.gangs[0].spec.ranks[0].env["MLFLOW_RUN_ID"] == tracker.run_id  # type: ignore[attr-defined]
    assert tracker.finished == [("FINISHED", None, [0, 1])]
    assert sup.watch is not None and not sup.watch.progress().reported  # progress still watched
    sup.release()


def test_bad_tracking_input_is_a_launch_error_before_any_rank_starts():
    def refuse(info, out):
        assert info.function == "fn" and info.world_size == 2
        raise LaunchError("run_id='nope' does not exist")

    sup = Supervisor(
        fn, (), {}, Options(processes=2, grace_period=0.1).validate(), stderr=io.StringIO(),
        gang_factory=lambda s, p, e: pytest.fail("a rank started"),
        planner=lambda f, opts: (Plan(2), None),
        pump_factory=lambda *a: FakePump(),
        tracking=refuse,
    )  # fmt: skip
    with pytest.raises(LaunchError, match="does not exist"):
        sup.start()
    assert sup.done() and sup.outcome.state is State.FAILED
    assert sup.run_dir and not os.path.exists(sup.run_dir)  # acquired, then released


def test_the_call_record_is_frozen_and_read_not_copied():
    sup = call(both_return)
    rec = sup.call
    assert (sup.run_id, sup.fn_name, sup.world_size) == (rec.run_id, rec.fn_name, 2)
    assert rec.options.processes == 2 and rec.plan.world_size == 2
    with pytest.raises(FrozenInstanceError):
        rec.run_id = "other"  # type: ignore[misc]
    assert "run_id" not in vars(sup) and "world_size" not in vars(sup)


def test_observers_composite_dispatches_typed_hooks():
    seen = Seen()
    group = Observers([Broken(), seen, Observer()])
    assert group.line_listeners == (group.all[0], seen)  # only those that override it
    group.on_rank_exit(1, -9, True)
    group.on_rank_line(0, "x")
    assert seen.events == [("exit", 1, -9, True), ("line", 0, "x")]


def test_the_notebook_panel_is_an_observer_of_the_call(monkeypatch):
    """The panel implements the lifecycle's protocol itself: handed over at construction, it
    draws "starting", then the end (ranks, status) from the hooks alone."""
    import IPython.display

    from gangrun.notebook.panel import Panel

    shown: list[dict] = []
    monkeypatch.setattr(IPython.display, "display", lambda b, **kw: shown.append(b))
    panel = Panel(shell=None, parent=None, refresh_s=60.0)
    sup = call(lambda g: (g.ret(0, "a"), g.fail(1, "boom")), observers=[panel])
    assert isinstance(sup.outcome.error, DistributedError)
    assert len(shown) >= 2 and "starting 2 ranks" in shown[0]["text/html"]
    assert panel.renders == len(shown)
    last = shown[-1]["text/html"]
    assert 'data-final="FAILED"' in last and "ValueError: boom" in last
    assert 'data-rank="0" data-state="finished"' in last
    assert 'data-rank="1" data-state="failed"' in last
    assert sup.call.fn_name in shown[-1]["text/plain"]
