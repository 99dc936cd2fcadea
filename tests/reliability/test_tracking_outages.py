"""Tracking outages against a real ``mlflow server`` on loopback (killed mid-call, or never
started), and a run resumed while its call still runs. A call must not sit in MLflow's
retries for minutes after its ranks ended, nor the ranks' ``mlflow.log_metric`` block and then
raise; ``submit()`` must not spend a minute in ``create_run``'s retries; a second call
resuming a run in use must not be accepted (it would end the run under the first)."""

from __future__ import annotations

import json
import os
import signal
import textwrap
import time

import pytest
from outage_funcs import logs_through_an_outage, quick, waits_for

import gangrun
from conftest import assert_no_survivors, run_python
from gangrun import LaunchError
from mlflow_server import BasicAuthProxy, MlflowServer, free_port

mlflow = pytest.importorskip("mlflow")
pytestmark = [pytest.mark.slow, pytest.mark.mlflow]  # every test here tracks


@pytest.fixture(scope="module")
def live_server(tmp_path_factory):
    """One real tracking server for this module (its start takes up to a minute on a loaded
    machine); the test that kills it runs last. Always stopped, no process left."""
    srv = MlflowServer(tmp_path_factory.mktemp("mlflow-server"))
    try:
        yield srv.start()
    finally:
        srv.stop()


@pytest.fixture
def server(live_server, monkeypatch):
    """The caller's store is the server for this test."""
    assert live_server.alive(), "the module's server was killed by an earlier test"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", live_server.url)
    for k in ("MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_ID", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(k, raising=False)
    mlflow.set_tracking_uri(live_server.url)
    yield live_server
    mlflow.set_tracking_uri(None)


def _wait_for(paths, timeout: float = 90.0, proc=None) -> None:
    deadline = time.monotonic() + timeout
    while not all(os.path.exists(p) for p in paths):
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the caller exited {proc.returncode}: {proc.stderr.read()}")
        assert time.monotonic() < deadline, f"not all of {paths} appeared"
        time.sleep(0.05)


def test_server_not_running_at_start_runs_untracked_at_once(monkeypatch, capsys):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    mlflow.set_tracking_uri(url)
    try:
        fn = gangrun.distributed(processes=2, timeout=90)(quick)
        t = time.monotonic()
        handle = fn.submit(1)
        submitted = time.monotonic() - t
        assert handle.result(timeout=60) == [1, 2]
    finally:
        mlflow.set_tracking_uri(None)
    assert submitted < 30, f"submit() took {submitted:.0f}s with the server down"  # was > 60
    out = capsys.readouterr().out
    notes = [ln for ln in out.splitlines() if "MLflow tracking is off for this call" in ln]
    assert len(notes) == 1 and url in notes[0] and "cannot be reached" in notes[0], out
    assert handle.mlflow_run_id is None


def test_finish_requests_are_bounded_when_the_server_hangs(server, tmp_path, capsys):
    """A server that accepts but never answers (SIGSTOPped): the finishing requests are
    given up after GANGRUN_TRACKING_TIMEOUT, with the same one-line note."""
    fn = gangrun.distributed(processes=2, timeout=90)(quick)
    handle = fn.submit(0)
    assert handle.mlflow_run_id, "the call is not tracked: nothing to prove"
    os.environ["GANGRUN_TRACKING_TIMEOUT"] = "5"  # read when the run is finished
    try:
        assert server.proc is not None
        os.killpg(server.proc.pid, signal.SIGSTOP)
        try:
            t = time.monotonic()
            assert handle.result(timeout=60) == [0, 1]
            took = time.monotonic() - t
        finally:
            os.killpg(server.proc.pid, signal.SIGCONT)
    finally:
        del os.environ["GANGRUN_TRACKING_TIMEOUT"]
    both = "".join(capsys.readouterr())
    assert f"the MLflow run {handle.mlflow_run_id} could not be finished" in both, both[-2000:]
    assert took < 45, took


CREDENTIALS_CALLER = """
import glob, json, os, sys, gangrun
from outage_funcs import logs_and_reads_its_call_record, quick

good, down, logs = sys.argv[1:4]
os.environ["MLFLOW_TRACKING_URI"] = down  # nothing listens there: runs untracked, says so
assert gangrun.distributed(processes=2, timeout=90)(quick).submit(1).result(60) == [1, 2]
os.environ["MLFLOW_TRACKING_URI"] = good
fn = gangrun.distributed(processes=2, timeout=90, log_dir=logs)(logs_and_reads_its_call_record)
h = fn.submit()
records = h.result(60)
print("RESULT " + json.dumps({"mlflow_run_id": h.mlflow_run_id, "records": records}))
"""


def test_credentials_in_the_uri_are_used_and_never_shown(live_server, tmp_path):
    """The probe must not take ``alice:PASSWORD@127.0.0.1`` for the host (the call would run
    untracked, its note printing the password): the server is probed with the credentials as HTTP basic authentication (a server without auth accepts any), the call
    is tracked, and no output, DEBUG narration, rank log or ``call.json`` holds the password."""
    assert live_server.alive()
    secret = "Pa55-w0rd-never-shown"
    good = live_server.url.replace("http://", f"http://alice:{secret}@")
    down = f"http://alice:{secret}@127.0.0.1:{free_port()}"
    here = os.path.dirname(os.path.abspath(__file__))
    proc = run_python(
        CREDENTIALS_CALLER,
        good,
        down,
        str(tmp_path / "logs"),
        env={
            "GANGRUN_LOG_LEVEL": "DEBUG",
            "PYTHONPATH": here + os.pathsep + os.environ["PYTHONPATH"],
            "MLFLOW_RUN_ID": None,
            "MLFLOW_EXPERIMENT_ID": None,
        },
        cwd=tmp_path,
        timeout=180,
    )
    both = proc.stdout + proc.stderr
    assert proc.returncode == 0, both[-3000:]
    assert secret not in both, [ln for ln in both.splitlines() if secret in ln]
    redacted = "http://alice:***@127.0.0.1:"
    note = next(ln for ln in proc.stdout.splitlines() if "tracking is off" in ln)
    assert f"tracking server {redacted}" in note and "cannot be reached" in note, note
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    run_id = result["mlflow_run_id"]
    assert run_id, both[-3000:]  # tracked, with the credentials URI
    assert f"{redacted}{live_server.port}/#/experiments/" in proc.stdout  # the run's link
    for record in result["records"]:
        assert secret not in record
        assert json.loads(record)["tracking_uri"] == f"{redacted}{live_server.port}"
    logs = [p for p in (tmp_path / "logs").rglob("*") if p.is_file()]
    assert logs
    for log in logs:
        assert secret not in log.read_text(errors="replace"), log
    run = mlflow.MlflowClient(tracking_uri=live_server.url).get_run(run_id)
    assert run.info.status == "FINISHED"
    assert {"cred0", "cred1"} <= set(run.data.metrics)


AUTH_CALLER = """
import json, sys, gangrun
from outage_funcs import logs_and_reads_its_call_record

fn = gangrun.distributed(processes=2, timeout=90, log_dir=sys.argv[1])
h = fn(logs_and_reads_its_call_record).submit()
h.result(60)
print("RESULT " + json.dumps({"mlflow_run_id": h.mlflow_run_id}))
"""


@pytest.mark.parametrize("given", ["in the URI", "in MLflow's variables"])
def test_a_server_behind_basic_auth_tracks_the_call(live_server, tmp_path, given):
    """Credentials, against a server that requires the credentials (the real server
    behind a real HTTP proxy that answers 401 without them): the call is tracked, every
    request (gangrun's probe, the caller's MLflow client, the ranks' metrics) carries them,
    given in the URI or in ``MLFLOW_TRACKING_USERNAME``/``PASSWORD``, and no output, DEBUG
    narration or rank log shows the password."""
    assert live_server.alive()
    secret = "Pr0xy-pa55-never-shown"
    proxy = BasicAuthProxy(live_server.url, "alice", secret)
    env: dict[str, str | None] = {
        "GANGRUN_LOG_LEVEL": "DEBUG",
        "PYTHONPATH": os.path.dirname(os.path.abspath(__file__))
        + os.pathsep
        + os.environ["PYTHONPATH"],
        "MLFLOW_RUN_ID": None,
        "MLFLOW_EXPERIMENT_ID": None,
        "MLFLOW_TRACKING_TOKEN": None,
    }
    if given == "in the URI":
        env["MLFLOW_TRACKING_URI"] = proxy.url.replace("http://", f"http://alice:{secret}@")
        env["MLFLOW_TRACKING_USERNAME"] = env["MLFLOW_TRACKING_PASSWORD"] = None
    else:
        env["MLFLOW_TRACKING_URI"] = proxy.url
        env["MLFLOW_TRACKING_USERNAME"], env["MLFLOW_TRACKING_PASSWORD"] = "alice", secret
    try:
        proc = run_python(AUTH_CALLER, str(tmp_path / "logs"), env=env, cwd=tmp_path, timeout=180)
    finally:
        proxy.stop()
    both = proc.stdout + proc.stderr
    assert proc.returncode == 0, both[-3000:]
    assert secret not in both, [ln for ln in both.splitlines() if secret in ln]
    run_id = json.loads(proc.stdout.split("RESULT ", 1)[1])["mlflow_run_id"]
    assert run_id, both[-3000:]  # tracked
    assert proxy.rejected == [], proxy.rejected  # every request authenticated
    assert proxy.served > 0
    for log in (p for p in (tmp_path / "logs").rglob("*") if p.is_file()):
        assert secret not in log.read_text(errors="replace"), log
    run = mlflow.MlflowClient(tracking_uri=live_server.url).get_run(run_id)
    assert run.info.status == "FINISHED"
    assert {"cred0", "cred1"} <= set(run.data.metrics)


def test_server_killed_mid_call_results_come_back(server, tmp_path, capsys):
    flags = tmp_path / "flags"
    flags.mkdir()
    fn = gangrun.distributed(processes=2, timeout=180)(logs_through_an_outage)
    handle = fn.submit(str(flags), 6.0)
    run_id = handle.mlflow_run_id
    assert run_id
    _wait_for([flags / "logged.0", flags / "logged.1"])
    server.kill()
    (flags / "killed").touch()
    # ranks log for 6 s after the outage; then the results must come back promptly (the old
    # code spent minutes in MLflow's retries, in the ranks and then in the caller)
    out = handle.result(timeout=60)
    assert [o["rank"] for o in out] == [0, 1]
    for o in out:
        assert o["steps"] > 10, out  # the loop kept running
        assert o["slowest_log"] < 5.0, out  # no logging call sat in MLflow's retries
    text = capsys.readouterr()
    both = text.out + text.err
    assert both.count("metrics the ranks log are being lost") == 1, both[-3000:]
    assert f"the MLflow run {run_id} could not be finished" in both, both[-3000:]
    assert "Failed to log run data" not in both, both[-3000:]  # MLflow's per-batch lines
    assert_no_survivors()


# ---------------------------------------------------------------- one run, one call
def test_resuming_a_run_in_use_is_refused_before_any_rank_starts(tmp_path, capsys):
    flag = tmp_path / "go"
    fn = gangrun.distributed(processes=2, timeout=120)(waits_for)
    first = fn.submit(str(flag))
    run_id = first.mlflow_run_id
    assert run_id
    second = fn.options(run_id=run_id)
    with pytest.raises(LaunchError) as info:
        second.submit(str(flag))
    msg = str(info.value)
    assert "in use by a running call" in msg, msg
    assert f"pid {os.getpid()}" in msg and os.uname().nodename in msg, msg
    assert first.run_id in msg, msg  # the call that holds it
    assert not first.done()
    client = mlflow.MlflowClient()
    assert client.get_run(run_id).info.status == "RUNNING"
    flag.touch()
    assert first.result(timeout=60) == [0, 1]
    assert client.get_run(run_id).info.status == "FINISHED"
    # once the first call is over, the run can be resumed
    assert second.distributed(str(flag)) == [0, 1]
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["gangrun.resumes"] == "1"
    assert "gangrun.lease" not in run.data.tags


def _another_caller(script, tmp_path, flag, then: str):
    """A caller subprocess whose call waits for ``flag``; then it runs ``then``. Returns the
    process and its call's MLflow run id, once the run exists."""
    ready = tmp_path / "run_id"
    code = f"""
    import os, sys, time
    sys.path.insert(0, {os.path.dirname(__file__)!r})
    import gangrun
    from outage_funcs import waits_for
    h = gangrun.distributed(processes=2, timeout=120)(waits_for).submit({str(flag)!r})
    with open({str(ready)!r} + ".tmp", "w") as f:
        f.write(h.mlflow_run_id)
    os.rename({str(ready)!r} + ".tmp", {str(ready)!r})
    {then}
    """
    proc = script(textwrap.dedent(code))
    try:
        _wait_for([ready], proc=proc)
    except BaseException:
        proc.kill()
        proc.wait(10)
        raise
    return proc, ready.read_text()


def test_a_run_whose_caller_was_sigkilled_resumes(tmp_path, script):
    """The first caller dies (a kernel SIGKILLed): nobody removed its lease; resuming works."""
    flag = tmp_path / "never"
    proc, run_id = _another_caller(script, tmp_path, flag, "time.sleep(120)")
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    assert_no_survivors(proc.pid, wait=15.0)
    client = mlflow.MlflowClient()
    run = client.get_run(run_id)
    assert run.info.status == "RUNNING" and "gangrun.lease" in run.data.tags
    flag.touch()
    fn = gangrun.distributed(processes=2, timeout=120, run_id=run_id)(waits_for)
    assert fn.distributed(str(flag)) == [0, 1]
    assert client.get_run(run_id).info.status == "FINISHED"


def test_a_live_call_in_another_process_is_named(tmp_path, script):
    flag = tmp_path / "go"
    proc, run_id = _another_caller(script, tmp_path, flag, "print(h.result(timeout=100))")
    try:
        fn = gangrun.distributed(processes=2, timeout=60, run_id=run_id)(waits_for)
        with pytest.raises(LaunchError, match=rf"in use by a running call .*pid {proc.pid}\)"):
            fn.submit(str(flag))
        flag.touch()
        out, err = proc.communicate(timeout=90)
        assert proc.returncode == 0, err[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert_no_survivors(proc.pid)
