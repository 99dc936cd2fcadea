"""Restarts that know what is worth retrying (docs/restarts.md), with real ranks and gloo.

Each function appends its attempt number and start time to a file (rank 0), so the tests
count the attempts that really ran and measure the back-off between them.
"""

from __future__ import annotations

import _thread
import json
import logging
import threading
import time

import pytest
import rel_funcs

import gangrun
from conftest import run_processes
from gangrun import DistributedCancelledError, DistributedError

pytestmark = pytest.mark.slow


def _attempts(log) -> list[tuple[int, float]]:
    if not log.exists():
        return []
    return [
        (int(a), float(t))
        for a, t in (line.split() for line in log.read_text().split("\n") if line)
    ]


def test_the_same_exception_at_the_same_line_runs_two_attempts(tmp_path):
    log = tmp_path / "attempts"
    fn = gangrun.distributed(processes=2, timeout=120, max_restarts=3, restart_backoff=0.2)(
        rel_funcs.same_line_after_a_step
    )
    with pytest.raises(DistributedError) as ei:
        fn.distributed(str(log))
    assert [a for a, _ in _attempts(log)] == [0, 1]  # not retried a second time
    err = ei.value
    assert err.rank == 0 and isinstance(err.__cause__, ValueError)
    text = str(err)
    assert text.startswith("Rank 0 ") and "ValueError: the loss is nan" in text.splitlines()[0]
    assert "2 attempts ran (max_restarts=3); restarts stopped: the same ValueError at " in text
    assert "rel_funcs.py:" in text and "in same_line_after_a_step failed two attempts" in text
    assert err.failures[0].frame and err.failures[0].frame.endswith("in same_line_after_a_step")


def test_an_import_error_before_any_progress_runs_once(tmp_path, capfd):
    log = tmp_path / "attempts"
    fn = gangrun.distributed(processes=2, timeout=120, max_restarts=3)(
        rel_funcs.import_before_progress
    )
    with pytest.raises(DistributedError) as ei:
        fn.distributed(str(log))
    assert [a for a, _ in _attempts(log)] == [0]
    text = str(ei.value)
    assert "ModuleNotFoundError: No module named 'gangrun_no_such_module'" in text
    assert "1 attempt ran (max_restarts=3); restarts stopped: ModuleNotFoundError at " in text
    assert "before any rank reported a step or a restore" in text
    assert "Restarting" not in capfd.readouterr().err


@pytest.mark.mlflow
def test_a_killed_rank_is_retried_with_back_off_in_one_mlflow_run(tmp_path, monkeypatch, caplog):
    mlflow = pytest.importorskip("mlflow")
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = mlflow.MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("restarts", artifact_location=str(tmp_path / "artifacts"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_ID", exp)
    caplog.set_level(logging.DEBUG, logger="gangrun")
    log = tmp_path / "attempts"
    fn = gangrun.distributed(processes=2, timeout=180, max_restarts=2, restart_backoff=1.5)(
        rel_funcs.killed_after_a_step
    )
    h = fn.submit(str(log))
    with pytest.raises(DistributedError) as ei:
        h.result(timeout=180)
    starts = _attempts(log)
    assert [a for a, _ in starts] == [0, 1, 2]  # retried up to max_restarts
    gaps = [starts[i + 1][1] - starts[i][1] for i in range(2)]
    assert gaps[0] >= 1.5 and gaps[1] >= 3.0, gaps  # the back-off doubles (1.5 s, then 3 s)
    err = ei.value
    assert err.rank == 1 and err.signal == "SIGKILL"
    assert "3 attempts ran (max_restarts=2); restarts stopped: max_restarts=2" in str(err)
    # every attempt in the one MLflow run
    run = client.get_run(h.mlflow_run_id)
    assert run.data.tags["gangrun.attempts"] == "3"
    assert "max_restarts=2 restarts were used up" in run.data.tags["gangrun.restarts_stopped"]
    assert run.info.status == "FAILED"
    path = client.download_artifacts(run.info.run_id, "gangrun_attempts.json", str(tmp_path))
    with open(path) as f:
        rows = json.load(f)["attempts"]
    assert [r["attempt"] for r in rows] == [1, 2, 3]
    assert [r["decision"] for r in rows] == ["restart", "restart", "stop"]
    assert [r["backoff_s"] for r in rows] == [1.5, 3.0, 0.0]
    waits = [rows[i + 1]["started"] - rows[i]["ended"] for i in range(2)]  # end -> next launch
    assert waits[0] >= 1.5 and waits[1] >= 3.0, waits
    for r in rows:
        f = r["failure"]
        assert (f["rank"], f["signal"], f["type"]) == (1, "SIGKILL", "DistributedError")
        assert "killed by SIGKILL" in f["message"] and f["time"] > 0
        assert r["last_step"] == 1 and r["resumed_from"] is None
    # a later call that resumes the run (run_id=) and succeeds: its own attempts, no stale reason
    again = gangrun.distributed(processes=2, timeout=120, run_id=run.info.run_id)
    assert again(rel_funcs.visible_devices).distributed(0.0) == ["", ""]
    tags = client.get_run(run.info.run_id).data.tags
    assert tags["gangrun.attempts"] == "1" and "gangrun.restarts_stopped" not in tags
    path = client.download_artifacts(
        run.info.run_id, "resume1/gangrun_attempts.json", str(tmp_path)
    )
    with open(path) as f:
        assert [r["state"] for r in json.load(f)["attempts"]] == ["succeeded"]
    said = caplog.text
    assert "waiting 1.5s before restart 1" in said and "waiting 3s before restart 2" in said
    assert "restart 1/2 in 1.5s" in said


def _wait_for_the_back_off(timeout: float = 120.0):
    """The one active call, once it is waiting to restart (its ranks are gone)."""
    from gangrun.lifecycle import calls

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        active = calls.active()
        if active and active[0].state.value == "restarting":  # type: ignore[attr-defined]
            return active[0]
        time.sleep(0.05)
    raise AssertionError("the call never reached its back-off")


def test_a_cancel_during_the_back_off_ends_the_call_promptly(tmp_path):
    log = tmp_path / "attempts"
    fn = gangrun.distributed(processes=2, timeout=180, max_restarts=3, restart_backoff=120)(
        rel_funcs.killed_after_a_step
    )
    h = fn.submit(str(log))
    _wait_for_the_back_off()
    assert not run_processes()  # nothing runs during the back-off
    t0 = time.monotonic()
    assert h.cancel()
    with pytest.raises(DistributedCancelledError) as ei:
        h.result(timeout=30)
    assert time.monotonic() - t0 < 15  # not the 120 s back-off
    assert "while waiting to restart (restart 1)" in str(ei.value)
    assert "1 attempt ran (max_restarts=3)" in str(ei.value)
    assert [a for a, _ in _attempts(log)] == [0]


def test_an_interrupt_during_the_back_off_ends_the_call_promptly(tmp_path):
    log = tmp_path / "attempts"
    fn = gangrun.distributed(processes=2, timeout=180, max_restarts=3, restart_backoff=120)(
        rel_funcs.killed_after_a_step
    )
    when: list[float] = []
    seen: list = []

    def interrupt() -> None:  # "interrupt kernel" while the cell waits in .distributed()
        seen.append(_wait_for_the_back_off())
        when.append(time.monotonic())
        _thread.interrupt_main()

    t = threading.Thread(target=interrupt, daemon=True)
    t.start()
    with pytest.raises(KeyboardInterrupt):
        fn.distributed(str(log))
    t.join(5)
    assert time.monotonic() - when[0] < 15  # the call ended (cancel waits for it) promptly
    sup = seen[0]
    assert sup.done() and isinstance(sup.outcome.error, DistributedCancelledError)
    assert "was interrupted while waiting to restart" in str(sup.outcome.error)
    assert [a for a, _ in _attempts(log)] == [0]


# ---------------------------------------------------------------- with a checkpoint manager
def test_a_bug_at_the_first_step_of_a_fresh_start_with_a_checkpointer_runs_once(tmp_path):
    """A restore that found no checkpoint is not progress: the bug is not retried (it was
    once, as the manager reported step 0); a restore that loaded one is progress."""
    log, where = tmp_path / "attempts", str(tmp_path / "ckpt")
    fn = gangrun.distributed(
        processes=1, timeout=120, max_restarts=2, restart_backoff=0, checkpoint_dir=where
    )(rel_funcs.bug_at_the_first_step)
    with pytest.raises(DistributedError) as ei:
        fn.distributed(str(log), 4, True)
    assert [a for a, _ in _attempts(log)] == [0]
    text = str(ei.value)
    assert "TypeError" in text.splitlines()[0]
    assert "1 attempt ran (max_restarts=2); restarts stopped: TypeError at " in text
    assert "before any rank reported a step or a restore" in text
    # the same bug after a restore that loaded step 2: retried once, then the same line stops
    log.unlink()
    assert fn.distributed(str(log), 2, False) == [2]
    with pytest.raises(DistributedError) as ei:
        fn.distributed(str(log), 4, True)
    assert [a for a, _ in _attempts(log)] == [0, 0, 1]
    assert "2 attempts ran (max_restarts=2); restarts stopped: the same TypeError at " in str(
        ei.value
    )


def test_nccl_not_built_in_is_not_retried(tmp_path, capfd):
    """This torch is CPU-only: init_process_group("nccl") fails the same way every time."""
    import torch.distributed as dist

    assert not dist.is_nccl_available()
    log = tmp_path / "attempts"
    fn = gangrun.distributed(processes=1, timeout=120, max_restarts=2, restart_backoff=0.1)(
        rel_funcs.init_nccl
    )
    with pytest.raises(DistributedError) as ei:
        fn.distributed(str(log))
    assert [a for a, _ in _attempts(log)] == [0]  # not retried
    text = str(ei.value)
    assert "Distributed package doesn't have NCCL built in" in text.splitlines()[0]
    assert "1 attempt ran (max_restarts=2); restarts stopped: RuntimeError at " in text
    assert 'says "Distributed package doesn\'t have NCCL built in"' in text
    assert "the process group's backend is not available in this torch or on this machine" in (text)
    assert "Restarting" not in capfd.readouterr().err


PREEMPTED_CALLER = """
import sys, threading, time
sys.path.insert(0, {here!r})
import gangrun, rel_funcs
from gangrun.lifecycle import calls

fn = gangrun.distributed(
    processes=1, timeout=120, max_restarts=3, restart_backoff=120, grace_period=20,
    output="none", checkpoint_dir={where!r})(rel_funcs.saves_then_killed)
h = fn.submit({log!r})
open({idfile!r}, "w").write(h.mlflow_run_id)

def back_off():
    while not any(c.state.value == "restarting" for c in calls.active()):
        time.sleep(0.05)
    open({flag!r}, "w").close()

threading.Thread(target=back_off, daemon=True).start()
h.result()
"""


@pytest.mark.mlflow
def test_sigterm_to_the_caller_during_the_back_off_is_a_preemption(tmp_path, script):
    """No rank runs during the back-off: the call ends at once, preempted, with the last
    complete checkpoint and the line that resumes it (not cancelled after grace_period)."""
    import os
    import signal

    from mlflow import MlflowClient

    from conftest import assert_no_survivors
    from gangrun import checkpoint

    where, flag, log = str(tmp_path / "ckpt"), tmp_path / "backoff", tmp_path / "attempts"
    here = os.path.dirname(os.path.abspath(rel_funcs.__file__))
    code = PREEMPTED_CALLER.format(
        here=here, where=where, log=str(log), idfile=str(tmp_path / "id"), flag=str(flag)
    )
    proc = script(code)
    deadline = time.monotonic() + 120
    while not flag.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the call never reached its back-off"
        time.sleep(0.05)
    assert not run_processes(proc.pid)  # nothing runs during the back-off
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    took = time.monotonic() - t0
    assert proc.returncode == 1, err
    assert took < 10, (took, err)  # at once, not after grace_period=20
    last = checkpoint.latest(where)
    assert last is not None and last.endswith("step-000000004")
    run_id = (tmp_path / "id").read_text()
    assert "DistributedPreemptedError: saves_then_killed was preempted while waiting to " in err
    assert (
        f"restart (restart 1); no rank was running: the last complete checkpoint is step 4, {last}."
        in err
    )
    assert "The attempt before failed: Rank 0 " in err and "killed by SIGKILL" in err
    assert (
        f"Resume it with:\n    saves_then_killed.options(run_id={run_id!r}).distributed(...)" in err
    )
    assert "DistributedCancelledError" not in err and "did not checkpoint" not in err
    assert [a for a, _ in _attempts(log)] == [0]
    assert MlflowClient().get_run(run_id).info.status == "KILLED"
    assert_no_survivors(proc.pid)
