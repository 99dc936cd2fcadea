"""The restart rules (lifecycle/policy.py) and the back-off between attempts, process-free.

The policy is judged on facts alone; the supervisor runs on the fake gang of
``tests/fakes.py`` (no processes, no MLflow).
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from fakes import FakeGang, both_return, call
from gangrun.errors import DistributedCancelledError, DistributedError, DistributedTimeoutError
from gangrun.lifecycle.attempts import annotate, attempts_json
from gangrun.lifecycle.policy import AttemptFacts, Decision, RestartPolicy
from gangrun.lifecycle.state import State
from gangrun.wire.records import user_frame

F = State.FAILED
AT = "train.py:12 in step"


def judge(facts, previous=None, restarts=0, **kw):
    kw.setdefault("max_restarts", 3)
    return RestartPolicy(**kw).judge(facts, previous, restarts)


@pytest.mark.parametrize(
    "facts",
    [
        AttemptFacts(F),  # killed by a signal / an exit status without an exception
        AttemptFacts(State.HUNG),
        AttemptFacts(F, "ConnectionResetError", "reset", AT),
        AttemptFacts(F, "RuntimeError", "[..] Connection reset by peer", AT),
        AttemptFacts(F, "torch.distributed.DistBackendError", "NCCL error", AT),
        AttemptFacts(F, "RuntimeError", "NCCL error in: x.cpp:1, unhandled system error", AT),
        AttemptFacts(F, "RuntimeError", "NCCL communicator was aborted on rank 1.", AT),
        AttemptFacts(F, "RuntimeError", "[Rank 0] NCCL watchdog thread terminated", AT),
        AttemptFacts(F, "RuntimeError", "Watchdog caught collective operation timeout", AT),
        AttemptFacts(F, "ray.ActorDiedError", "the node was lost", None),
        AttemptFacts(F, "TimeoutError", "store", AT),
    ],
)
def test_worth_retrying_even_before_progress_and_twice_at_one_line(facts):
    v = judge(facts, previous=facts)
    assert v.decision is Decision.RESTART and v.kind == "restart"
    assert v.backoff == 1.0  # the first restart: quick


def test_an_exception_before_any_progress_is_not_retried():
    v = judge(AttemptFacts(F, "ModuleNotFoundError", "No module named 'x'", AT))
    assert (v.decision, v.kind) == (Decision.STOP, "no_progress")
    assert "ModuleNotFoundError at train.py:12 in step" in v.reason
    assert "before any rank reported a step or a restore" in v.reason


def test_sys_exit_before_progress_is_retried_once_then_repeats():
    first = AttemptFacts(F, "SystemExit", "exited with code 3", AT)
    assert judge(first).decision is Decision.RESTART
    assert judge(first, previous=first, restarts=1).kind == "repeated"


def test_same_exception_at_the_same_user_line_twice_stops():
    once = AttemptFacts(F, "ValueError", "nan loss", AT, progressed=True)
    assert judge(once).decision is Decision.RESTART
    v = judge(once, previous=once, restarts=1)
    assert (v.decision, v.kind) == (Decision.STOP, "repeated")
    assert "same ValueError at train.py:12 in step failed two attempts in a row" in v.reason


@pytest.mark.parametrize(
    "other",
    [
        AttemptFacts(F, "ValueError", "x", "train.py:40 in step", progressed=True),  # other line
        AttemptFacts(F, "KeyError", "x", AT, progressed=True),  # other type
        AttemptFacts(F, progressed=True),  # a kill in between
    ],
)
def test_a_different_failure_in_between_is_retried(other):
    now = AttemptFacts(F, "ValueError", "nan loss", AT, progressed=True)
    assert judge(now, previous=other, restarts=1).decision is Decision.RESTART


def test_no_user_frame_never_counts_as_the_same_line():
    now = AttemptFacts(F, "ValueError", "x", None, progressed=True)
    assert judge(now, previous=now, restarts=1).decision is Decision.RESTART


def test_unserializable_result_is_not_retried():
    v = judge(AttemptFacts(F, "ResultSerializationError", "cannot pickle", None, True))
    assert (v.decision, v.kind) == (Decision.STOP, "result")


def test_exhausted_and_not_retryable():
    assert judge(AttemptFacts(F), restarts=3).kind == "exhausted"
    assert judge(AttemptFacts(F), max_restarts=0).kind == "exhausted"
    for s in (State.TIMED_OUT, State.CANCELLED, State.SUCCEEDED):
        assert judge(AttemptFacts(s)).kind == "not_retryable"


def test_back_off_doubles_up_to_the_cap():
    p = RestartPolicy(10, backoff=0.5, backoff_max=3.0)
    assert [p.delay(k) for k in range(1, 7)] == [0.5, 1.0, 2.0, 3.0, 3.0, 3.0]
    assert RestartPolicy(10, backoff=0).delay(5) == 0.0
    assert RestartPolicy(10).delay(1000) == 60.0
    v = RestartPolicy(10, backoff=0.5, backoff_max=3.0).judge(AttemptFacts(F), None, 2)
    assert v.backoff == 2.0 and "restart 3/10 in 2s" in v.reason


def test_user_frame_skips_library_frames():
    try:
        json.loads("{not json")  # raised inside the standard library
    except ValueError as exc:
        frame = user_frame(exc)
    assert frame is not None and frame.startswith(__file__ + ":")
    assert frame.endswith("in test_user_frame_skips_library_frames")
    try:
        import gangrun_no_such_module  # noqa: F401
    except ImportError as exc:
        assert "test_restart_policy.py" in (user_frame(exc) or "")


# ---------------------------------------------------------------- with the supervisor
def _killed(g: FakeGang) -> None:
    g.step(1, 4)
    g.exit(1, -9)


def test_back_off_is_observed_between_attempts():
    sup = call(_killed, _killed, both_return, max_restarts=3, restart_backoff=0.3)
    assert sup.result() == ["a", "b"]
    a = sup.outcome.attempts
    assert [x.decision for x in a] == [Decision.RESTART, Decision.RESTART, Decision.STOP]
    assert [x.backoff for x in a] == [0.3, 0.6, 0.0]
    gaps = [a[i + 1].started - a[i].ended for i in range(2)]
    assert gaps[0] >= 0.3 and gaps[1] >= 0.6
    assert a[0].last_step == 4 and a[0].resumed_from is None
    assert "(restart 2/3) in 0.6s" in sup.call.stderr.getvalue()  # type: ignore[attr-defined]
    rows = json.loads(attempts_json(a))["attempts"]
    assert [r["attempt"] for r in rows] == [1, 2, 3]
    assert [r["world_size"] for r in rows] == [2, 2, 2]  # each attempt's (a resume may differ)
    assert rows[0]["failure"]["rank"] == 1 and rows[0]["failure"]["signal"] == "SIGKILL"
    assert rows[2]["failure"] is None and rows[2]["state"] == "succeeded"


def test_repeat_stops_and_the_error_says_how_many_attempts_ran():
    def boom(g: FakeGang) -> None:
        g.step(0, 2, resumed=1)
        g.fail(0, "nan loss", frame=AT)

    sup = call(boom, max_restarts=3)
    assert len(sup.outcome.attempts) == 2 and sup.outcome.state is State.FAILED
    text = str(sup.outcome.error)
    assert text.startswith("Rank 0 (pid 10000000) failed: ValueError: nan loss")
    assert "2 attempts ran (max_restarts=3); restarts stopped: the same ValueError at" in text
    assert sup.outcome.attempts[1].resumed_from == 1


def test_exception_before_progress_runs_once():
    sup = call(
        lambda g: g.fail(1, "No module named 'x'", exc="ModuleNotFoundError"), max_restarts=3
    )
    assert len(sup.outcome.attempts) == 1
    assert "1 attempt ran (max_restarts=3); restarts stopped: ModuleNotFoundError was raised" in (
        str(sup.outcome.error)
    )


def _start_cancel(sup_box: list, after: float) -> threading.Thread:
    def go() -> None:
        while not sup_box:
            time.sleep(0.01)
        time.sleep(after)
        sup_box[0].cancel("cancelled", wait=5)

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


def test_cancel_during_the_back_off_ends_promptly(monkeypatch):
    from gangrun.lifecycle import supervisor as sv

    box: list = []
    real_start = sv.Supervisor.start

    def start(self):  # hand the supervisor to the canceller as soon as it exists
        box.append(self)
        real_start(self)

    monkeypatch.setattr(sv.Supervisor, "start", start)
    t0 = time.monotonic()
    t = _start_cancel(box, 0.5)
    sup = call(_killed, max_restarts=3, restart_backoff=30.0)
    took = time.monotonic() - t0
    t.join(5)
    assert took < 10, took  # not the 30 s back-off
    err = sup.outcome.error
    assert isinstance(err, DistributedCancelledError) and sup.outcome.state is State.CANCELLED
    assert "while waiting to restart (restart 1)" in str(err)
    assert "The attempt before failed: Rank 1 (pid 10000001) was killed by SIGKILL" in str(err)
    assert isinstance(err.__cause__, DistributedError) and err.__cause__.rank == 1
    assert "1 attempt ran (max_restarts=3)" in str(err)
    assert len(sup.gangs) == 1  # type: ignore[attr-defined]


def test_timeout_during_the_back_off_ends_the_call():
    sup = call(_killed, max_restarts=3, restart_backoff=30.0, timeout=1.0)
    err = sup.outcome.error
    assert isinstance(err, DistributedTimeoutError) and sup.outcome.state is State.TIMED_OUT
    assert "it ran out while waiting to restart" in str(err)
    assert sup.outcome.mlflow_status == "KILLED"


def test_annotate_leaves_calls_without_restarts_alone():
    err = DistributedTimeoutError("x")
    annotate(err, [], 0)
    assert str(err) == "x"


@pytest.mark.parametrize(
    ("exc_type", "message"),
    [
        ("RuntimeError", "Distributed package doesn't have NCCL built in"),
        ("ValueError", "ProcessGroupNCCL is only supported with GPUs, no GPUs found!"),
        ("torch.distributed.DistBackendError", "ProcessGroupNCCL is only supported with GPUs"),
        ("RuntimeError", "NCCL is not available"),
    ],
)
def test_an_unavailable_nccl_stops_at_once_even_after_progress(exc_type, message):
    facts = AttemptFacts(F, exc_type, message, AT, progressed=True)
    v = judge(facts)
    assert (v.decision, v.kind) == (Decision.STOP, "unavailable")
    assert v.reason.startswith(f"{exc_type} at {AT} says ")
    assert "backend is not available in this torch or on this machine" in v.reason
    assert 'on CPUs use "gloo"' in v.reason


def test_peer_echoes_are_one_list_with_the_transient_texts():
    from gangrun.lifecycle import rootcause
    from gangrun.lifecycle.policy import PEER_ECHO_TEXT, TRANSIENT_TEXT, is_transient_exception
    from gangrun.wire.records import RankFailure

    assert set(PEER_ECHO_TEXT) <= set(TRANSIENT_TEXT)
    echo = RankFailure(1, 1, None, "RuntimeError", "[..] Connection reset by peer", None, 0.0)
    assert rootcause.is_peer_echo(echo)
    assert is_transient_exception(echo.exc_type or "", echo.message)


def test_a_preemption_while_the_attempt_fails_ends_it_preempted_not_restarted(
    tmp_path, monkeypatch
):
    """Asked to save and stop, the ranks failed first (a rank killed): no restart, and no
    wait for ``grace_period``; the call is preempted, from the last complete checkpoint."""
    from gangrun.errors import DistributedPreemptedError
    from gangrun.lifecycle import supervisor as sv
    from gangrun.wire import contract

    where = str(tmp_path / "ckpt")  # no checkpoint was saved yet
    monkeypatch.setattr(sv, "prepare", lambda sup: {contract.CHECKPOINT_DIR: where})
    box: list = []
    real_start = sv.Supervisor.start

    def start(self):
        box.append(self)
        real_start(self)

    def preempted_then_killed(g: FakeGang) -> None:
        g.step(0, 4)
        assert box[0].cancel("preempted", wait=0.0, checkpoint=True)
        g.exit(1, -9)

    monkeypatch.setattr(sv.Supervisor, "start", start)
    t0 = time.monotonic()
    sup = call(preempted_then_killed, max_restarts=3, restart_backoff=30.0, grace_period=30)
    assert time.monotonic() - t0 < 10  # neither the back-off nor grace_period
    err = sup.outcome.error
    assert isinstance(err, DistributedPreemptedError) and sup.outcome.state is State.CANCELLED
    assert sup.outcome.mlflow_status == "KILLED" and len(sup.gangs) == 1  # type: ignore[attr-defined]
    assert (err.checkpoint, err.step, err.mlflow_run_id) == (None, None, None)
    assert f"no checkpoint in {where} is complete: a resume starts at step 0" in str(err)
    assert err.resume == f"fn.options(checkpoint_dir={where!r}).distributed(...)"
    assert str(err).endswith(
        f"Resume it with:\n    {err.resume}\n\n1 attempt ran (max_restarts=3)."
    )
