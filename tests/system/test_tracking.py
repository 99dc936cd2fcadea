"""MLflow run per call, against a real sqlite store."""

from __future__ import annotations

import os
import time

import psutil
import pytest

import gangrun
from conftest import assert_no_survivors
from gangrun import DistributedError, DistributedTimeoutError, distributed
from gangrun.tracking import resolve_tracking_uri, run_link

pytestmark = pytest.mark.mlflow  # every test here tracks (conftest turns MLflow off)

mlflow = pytest.importorskip("mlflow")


@pytest.fixture(scope="module")
def _store_uri(tmp_path_factory):
    """One sqlite store for this module (creating one costs ~3 s of migrations)."""
    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow')}/mlflow.db"
    mlflow.MlflowClient(tracking_uri=uri).search_experiments()
    return uri


@pytest.fixture
def store(_store_uri, tmp_path, monkeypatch, request):
    """That store, with an experiment (and artifact root) of this test's own, chosen the way
    users do (MLFLOW_EXPERIMENT_ID)."""
    client = mlflow.MlflowClient(tracking_uri=_store_uri)
    exp = client.create_experiment(
        f"{request.node.name}-{time.time_ns()}", artifact_location=str(tmp_path / "artifacts")
    )
    monkeypatch.setenv("MLFLOW_TRACKING_URI", _store_uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_ID", exp)
    monkeypatch.chdir(tmp_path)
    client.experiment_id = exp
    return client


def _wait_for(cond, timeout=30.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@distributed(processes=2, timeout=60)
def _train(lr: float, epochs: int = 3, tag: str = "x") -> int:
    import os

    import mlflow

    rank = int(os.environ["RANK"])
    for step in range(epochs):
        mlflow.log_metric(f"rank{rank}/loss", lr * (epochs - step), step=step)
    # queued asynchronously: only the rank's before_exit flush makes it land
    mlflow.log_metric(f"rank{rank}/final", 1.0, synchronous=False)
    print(f"trained on rank {rank}")
    return rank


def test_run_has_metrics_from_every_rank_params_and_logs(store, capsys):
    handle = _train.submit(0.5, epochs=3, tag="hello")
    assert handle.result(timeout=60) == [0, 1]
    run_id = handle.mlflow_run_id
    assert run_id
    out = capsys.readouterr().out
    assert f"gangrun: MLflow run {run_id}" in out
    assert "mlflow ui --backend-store-uri" in out

    run = store.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.info.experiment_id == store.experiment_id
    for rank in (0, 1):
        hist = store.get_metric_history(run_id, f"rank{rank}/loss")
        assert sorted(m.step for m in hist) == [0, 1, 2]
        assert run.data.metrics[f"rank{rank}/final"] == 1.0
    p = run.data.params
    assert p["function"].endswith("_train")
    assert (p["world_size"], p["processes"], p["timeout"]) == ("2", "2", "60")
    assert (p["lr"], p["epochs"], p["tag"]) == ("0.5", "3", "hello")  # positional by name
    assert "arg0" not in p
    t = run.data.tags
    assert t["gangrun.version"] == gangrun.__version__
    assert t["gangrun.host"]
    assert t["gangrun.run_id"] == handle.run_id
    assert "mlflow.parentRunId" not in t

    arts = sorted(a.path for a in store.list_artifacts(run_id, "logs"))
    assert arts == ["logs/rank-0.log", "logs/rank-1.log"]
    local = store.download_artifacts(run_id, "logs/rank-1.log")
    with open(local) as f:
        assert "trained on rank 1" in f.read()


def test_nested_under_the_callers_active_run(store):
    with mlflow.start_run() as parent:
        handle = _train.submit(0.1, epochs=1)
        handle.result(timeout=60)
        # the caller's fluent run stack is untouched
        assert mlflow.active_run().info.run_id == parent.info.run_id
        assert store.get_run(parent.info.run_id).info.status == "RUNNING"
    child = store.get_run(handle.mlflow_run_id)
    assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
    assert child.info.experiment_id == parent.info.experiment_id
    assert child.info.status == "FINISHED"
    assert store.get_run(parent.info.run_id).info.status == "FINISHED"


def _rank_alive(rank: int) -> bool:
    me = str(os.getpid())
    for p in psutil.process_iter():
        try:
            env = p.environ()
            if env.get("GANGRUN_CALLER_PID") == me and env.get("RANK") == str(rank):
                return p.status() != psutil.STATUS_ZOMBIE
        except (psutil.Error, OSError):
            continue
    return False


def test_a_rank_exit_or_crash_does_not_end_the_run(store, tmp_path):
    gate = tmp_path / "gate"

    @distributed(processes=2, timeout=60)
    def uneven(gate: str) -> None:
        import os
        import time

        import mlflow

        rank = int(os.environ["RANK"])
        if rank == 0:
            mlflow.log_metric("rank0/started", 1)
            print("rank 0 done", flush=True)
            return  # this rank exits early: the run must stay RUNNING
        with mlflow.start_run():  # resumes the call's run; an exception marks it FAILED here
            mlflow.log_metric("rank1/started", 1)
            deadline = time.monotonic() + 30
            while not os.path.exists(gate) and time.monotonic() < deadline:
                time.sleep(0.05)
            raise ValueError("boom in rank 1")

    handle = uneven.submit(str(gate))
    run_id = handle.mlflow_run_id
    _wait_for(lambda: "rank 0 done" in handle.logs(0), what="rank 0 output")
    _wait_for(lambda: not _rank_alive(0), what="rank 0 exit")
    _wait_for(lambda: "rank1/started" in store.get_run(run_id).data.metrics, what="rank 1 metric")
    assert store.get_run(run_id).info.status == "RUNNING"  # rank 0's exit did not end it
    gate.write_text("go")
    with pytest.raises(DistributedError) as ei:
        handle.result(timeout=60)
    assert ei.value.rank == 1
    run = store.get_run(run_id)
    assert run.info.status == "FAILED"
    assert "boom in rank 1" in run.data.tags["gangrun.error"]
    assert "Rank 1" in run.data.tags["gangrun.error"]
    assert run.data.tags["gangrun.error_rank"] == "1"
    assert {a.path for a in store.list_artifacts(run_id, "logs")} == {
        "logs/rank-0.log",
        "logs/rank-1.log",
    }
    text = mlflow.artifacts.load_text(f"runs:/{run_id}/gangrun_error.txt")
    assert "ValueError" in text


@distributed(processes=2, timeout=60)
def _sleeper() -> None:
    import os
    import time

    import mlflow

    mlflow.log_metric(f"rank{os.environ['RANK']}/alive", 1)
    print("sleeping", flush=True)
    time.sleep(120)


def test_timeout_marks_the_run_killed(store):
    handle = _sleeper.options(timeout=4).submit()
    with pytest.raises(DistributedTimeoutError):
        handle.result(timeout=60)
    run = store.get_run(handle.mlflow_run_id)
    assert run.info.status == "KILLED"
    assert "timeout" in run.data.tags["gangrun.status_reason"]


def test_cancel_marks_the_run_killed(store):
    handle = _sleeper.submit()
    _wait_for(lambda: "sleeping" in handle.logs(1), what="rank 1 output")
    assert handle.cancel(wait=30)  # the run is ended once the call has
    run = store.get_run(handle.mlflow_run_id)
    assert run.info.status == "KILLED"
    assert "cancelled" in run.data.tags["gangrun.status_reason"]
    assert {a.path for a in store.list_artifacts(run.info.run_id, "logs")} == {
        "logs/rank-0.log",
        "logs/rank-1.log",
    }


@pytest.mark.slow
def test_observers_given_keep_the_mlflow_run(store):
    """Observers handed to a call are added to the built-in ones: the MLflow run is
    still created, reached by both real ranks, and ended FINISHED with their logs."""
    import io

    from gangrun.api import Options
    from gangrun.lifecycle import State, Supervisor
    from gangrun.lifecycle.observers import Observer

    class Seen(Observer):
        def __init__(self):
            self.states, self.exits, self.tracked = [], [], None

        def on_transition(self, state, run):
            self.states.append(state)
            if state is State.RUNNING:
                self.tracked = run.tracker.run_id

        def on_rank_exit(self, rank, exitcode, stopped):
            self.exits.append((rank, exitcode))

    def logs_a_metric() -> int:  # by value (importing this module in a rank would not do)
        import os

        import mlflow

        rank = int(os.environ["RANK"])
        mlflow.log_metric(f"rank{rank}/seen", 1.0, step=0)  # lands on the call's run
        return rank

    seen, out = Seen(), io.StringIO()
    opts = Options(processes=2, timeout=60, mlflow=True).validate()
    sup = Supervisor(logs_a_metric, (), {}, opts, stdout=out, observers=[seen])
    try:
        sup.start()
        assert sup.wait(60) and sup.result() == [0, 1]
        run_id = sup.mlflow_run_id
        assert run_id and seen.tracked == run_id
        assert f"gangrun: MLflow run {run_id}" in out.getvalue()
        run = store.get_run(run_id)
        assert run.info.status == "FINISHED" and run.info.experiment_id == store.experiment_id
        assert run.data.metrics == {"rank0/seen": 1.0, "rank1/seen": 1.0}
        assert {a.path for a in store.list_artifacts(run_id, "logs")} == {
            "logs/rank-0.log",
            "logs/rank-1.log",
        }
        assert seen.states[-1] is State.SUCCEEDED and sorted(seen.exits) == [(0, 0), (1, 0)]
    finally:
        sup.cancel(wait=30)
        sup.release()


def test_mlflow_false_creates_nothing(tmp_path, monkeypatch, capsys):
    db = tmp_path / "mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{db}")
    monkeypatch.chdir(tmp_path)

    @distributed(processes=2, timeout=60, mlflow=False)
    def env_of_rank() -> tuple:
        import os

        return os.environ.get("MLFLOW_RUN_ID"), os.environ.get("MLFLOW_EXPERIMENT_ID")

    handle = env_of_rank.submit()
    assert handle.result(timeout=60) == [(None, None), (None, None)]
    assert handle.mlflow_run_id is None
    assert "MLflow run" not in capsys.readouterr().out
    assert sorted(os.listdir(tmp_path)) == []  # no store, no ./mlruns


def test_default_store_is_absolute_for_the_ranks(script, tmp_path, monkeypatch):
    """No tracking URI configured: MLflow's own default (sqlite:///mlflow.db in the caller's
    cwd) is what the ranks get, as an absolute URI, and their metrics land in it."""
    for k in list(os.environ):
        if k.startswith("MLFLOW_") and k != "MLFLOW_DISABLE_TELEMETRY":
            monkeypatch.delenv(k)
    proc = script(
        """
        import os, sys
        from gangrun import distributed

        @distributed(processes=2, timeout=60)
        def f():
            import os, mlflow
            os.chdir("/")  # a rank that changes directory still reaches the same store
            mlflow.log_metric("rank" + os.environ["RANK"], 1.0)
            return os.environ["MLFLOW_TRACKING_URI"]

        h = f.submit()
        print("URIS", h.result(timeout=60), h.mlflow_run_id)
        """
    )
    try:
        out, err = proc.communicate(timeout=90)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert_no_survivors(proc.pid)
    want = f"sqlite:///{tmp_path}/mlflow.db"
    line = next(ln for ln in out.splitlines() if ln.startswith("URIS"))
    assert line.count(want) == 2, out
    run = mlflow.MlflowClient(tracking_uri=want).get_run(line.split()[-1])
    assert set(run.data.metrics) == {"rank0", "rank1"}
    assert run.info.status == "FINISHED"


def test_resolve_tracking_uri():
    assert resolve_tracking_uri("sqlite:///x.db", "/a") == "sqlite:////a/x.db"
    assert resolve_tracking_uri("sqlite:////abs/x.db", "/a") == "sqlite:////abs/x.db"
    assert resolve_tracking_uri("sqlite:///x.db?timeout=5", "/a") == "sqlite:////a/x.db?timeout=5"
    assert resolve_tracking_uri("mlruns", "/a") == "/a/mlruns"
    assert resolve_tracking_uri("file:./mlruns", "/a") == "file:///a/mlruns"
    assert resolve_tracking_uri("file:///abs/mlruns", "/a") == "file:///abs/mlruns"
    assert resolve_tracking_uri("http://host:5000", "/a") == "http://host:5000"
    assert resolve_tracking_uri("databricks", "/a") == "databricks"


@pytest.mark.slow
def test_system_metrics_logged_by_the_caller(store, monkeypatch):
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.5")

    @distributed(processes=2, timeout=60, log_system_metrics=True)
    def nap() -> None:
        import time

        time.sleep(2.5)

    handle = nap.submit()
    handle.result(timeout=60)
    metrics = store.get_run(handle.mlflow_run_id).data.metrics
    assert any(k.startswith("system/cpu") for k in metrics), sorted(metrics)


def test_run_link_forms():
    url = run_link("https://mlflow.example.com/", "7", "abc")
    assert url.endswith("https://mlflow.example.com/#/experiments/7/runs/abc")
    local = run_link("sqlite:////tmp/my store/mlflow.db", "0", "abc")
    assert "run abc" in local
    assert "mlflow ui --backend-store-uri 'sqlite:////tmp/my store/mlflow.db'" in local


def test_unusable_store_warns_and_the_call_still_runs(tmp_path, monkeypatch, capsys):
    (tmp_path / "not-a-dir").write_text("")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/not-a-dir/mlflow.db")
    monkeypatch.chdir(tmp_path)

    @distributed(processes=2, timeout=60)
    def rank_of() -> int:
        import os

        return int(os.environ["RANK"])

    handle = rank_of.submit()
    assert handle.result(timeout=60) == [0, 1]
    assert handle.mlflow_run_id is None
    assert "MLflow tracking is off for this call" in capsys.readouterr().out
