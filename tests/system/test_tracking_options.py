"""MLflow options against a real sqlite store and a real ``mlflow server``:
experiment/run names and tags, resuming a run, parameter names, runs opened in ranks."""

from __future__ import annotations

import os
import sys
import time

import psutil
import pytest

from conftest import run_bounded
from gangrun import DistributedError, LaunchError, distributed
from mlflow_server import MlflowServer

pytestmark = pytest.mark.mlflow  # every test here tracks (conftest turns MLflow off)

mlflow = pytest.importorskip("mlflow")


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """A real tracking server on a free loopback port: sqlite backend, artifacts under tmp."""
    server = MlflowServer(tmp_path_factory.mktemp("mlflow-server")).start()
    try:
        yield server.url
    finally:
        server.stop()  # asserts that none of its processes survived


@pytest.fixture(scope="module")
def sqlite_uri(tmp_path_factory):
    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow')}/mlflow.db"
    mlflow.MlflowClient(tracking_uri=uri).search_experiments()  # migrations once per module
    return uri


@pytest.fixture(params=["sqlite", "server"])
def store(request, tmp_path, monkeypatch):
    """A client on that store, which the caller also uses (MLFLOW_TRACKING_URI); an experiment
    of this test's own as the caller's active one (MLFLOW_EXPERIMENT_ID)."""
    uri = request.getfixturevalue("sqlite_uri" if request.param == "sqlite" else "mlflow_server")
    client = mlflow.MlflowClient(tracking_uri=uri)
    kw = {"artifact_location": str(tmp_path / "art")} if request.param == "sqlite" else {}
    exp = client.create_experiment(f"{request.node.name}-{time.time_ns()}", **kw)
    for k in ("MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_ID", exp)
    monkeypatch.chdir(tmp_path)
    mlflow.set_tracking_uri(uri)
    client.uri, client.kind, client.experiment_id = uri, request.param, exp
    yield client
    mlflow.set_tracking_uri(None)
    while mlflow.active_run() is not None:
        mlflow.end_run()


def _steps(client, run_id, key):
    return sorted(m.step for m in client.get_metric_history(run_id, key))


@distributed(processes=2, timeout=90)
def train(lr: float, epochs: int, start_file: str = "", fail_at: int = -1) -> int:
    """Logs loss for steps [start, epochs); the start step comes from a "checkpoint" file that
    rank 0 writes after each step. ``fail_at``: rank 1 fails there, once rank 0 got there."""
    import os
    import time

    import mlflow

    def saved() -> int:
        if start_file and os.path.exists(start_file):
            with open(start_file) as f:
                return int(f.read() or 0)
        return 0

    rank = int(os.environ["RANK"])
    for step in range(saved(), epochs):
        if step == fail_at:
            if rank == 0:
                time.sleep(80)  # stopped by the teardown
            deadline = time.monotonic() + 60
            while saved() != fail_at and time.monotonic() < deadline:
                time.sleep(0.05)
            raise RuntimeError(f"lost rank 1 at step {step}")
        mlflow.log_metric(f"loss/{rank}", lr * (epochs - step), step=step)
        if rank == 0 and start_file:
            with open(start_file, "w") as f:
                f.write(str(step + 1))
    return rank


@pytest.mark.slow
def test_names_tags_and_positional_args_land(store, capsys):
    exp_name = f"named-{store.kind}-{time.time_ns()}"
    assert store.get_experiment_by_name(exp_name) is None
    h = train.options(experiment_name=exp_name, run_name="nightly", tags={"team": "vision"}).submit(
        0.5, 2
    )
    assert h.result(timeout=90) == [0, 1]
    run = store.get_run(h.mlflow_run_id)
    exp = store.get_experiment_by_name(exp_name)  # created
    assert run.info.experiment_id == exp.experiment_id
    assert run.info.run_name == "nightly"
    assert run.info.status == "FINISHED"
    assert run.data.tags["team"] == "vision"
    assert run.data.tags["mlflow.user"]
    p = run.data.params
    assert (p["lr"], p["epochs"], p["fail_at"]) == ("0.5", "2", "-1")
    assert not [k for k in p if k.startswith("arg")], p
    assert _steps(store, run.info.run_id, "loss/1") == [0, 1]
    assert not [k for k in run.data.metrics if k.startswith("system/")]  # processes=: off
    out = capsys.readouterr().out
    if store.kind == "server":  # the printed link is the UI URL
        url = f"{store.uri}/#/experiments/{exp.experiment_id}/runs/{run.info.run_id}"
        assert url in out, out
    else:
        assert f"mlflow ui --backend-store-uri {store.uri}" in out


@pytest.mark.slow
def test_resume_keeps_one_run_and_one_history(store, tmp_path, capsys):
    ckpt = str(tmp_path / "step")
    first = train.options(run_name="resumable").submit(0.1, 4, ckpt, fail_at=2)
    with pytest.raises(DistributedError, match="lost rank 1 at step 2"):
        first.result(timeout=90)
    run_id = first.mlflow_run_id
    failed = store.get_run(run_id)
    assert failed.info.status == "FAILED"
    assert "gangrun.error" in failed.data.tags

    second = train.options(run_id=run_id).submit(0.2, 4, ckpt)
    assert second.result(timeout=90) == [0, 1]
    assert second.mlflow_run_id == run_id
    assert f"MLflow run {run_id} (resumed)" in capsys.readouterr().out
    run = store.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "resumable"  # no run_name=: the name stays
    assert _steps(store, run_id, "loss/0") == [0, 1, 2, 3]  # both calls' steps, one history
    p = run.data.params
    assert p["lr"] == "0.1" and p["resume1.lr"] == "0.2"  # first values kept; ours findable
    assert p["fail_at"] == "2" and p["resume1.fail_at"] == "-1"
    assert "resume1.epochs" not in p  # unchanged values are not repeated
    assert run.data.tags["gangrun.resumes"] == "1"
    assert "gangrun.error" not in run.data.tags  # the failed attempt's error is gone
    arts = {a.path for a in store.list_artifacts(run_id, "logs/resume1")}
    assert arts == {"logs/resume1/rank-0.log", "logs/resume1/rank-1.log"}
    assert {a.path for a in store.list_artifacts(run_id, "logs")} >= {"logs/rank-1.log"}


@pytest.mark.slow
def test_mlflow_run_id_in_the_environment_resumes(store, tmp_path, monkeypatch):
    h1 = train.submit(0.1, 2)
    h1.result(timeout=90)
    monkeypatch.setenv("MLFLOW_RUN_ID", h1.mlflow_run_id)
    (tmp_path / "step").write_text("2")
    h2 = train.options(run_name="renamed").submit(0.1, 3, str(tmp_path / "step"))
    h2.result(timeout=90)
    assert h2.mlflow_run_id == h1.mlflow_run_id
    run = store.get_run(h1.mlflow_run_id)
    assert (run.info.status, run.info.run_name) == ("FINISHED", "renamed")
    assert _steps(store, run.info.run_id, "loss/0") == [0, 1, 2]
    assert "resume1.start_file" in run.data.params
    if store.kind == "server":
        return
    # an active fluent run in the caller wins: the call's run is its child, nothing resumed
    with mlflow.start_run() as parent:
        monkeypatch.setenv("MLFLOW_RUN_ID", h1.mlflow_run_id)
        h3 = train.submit(0.1, 1)
        h3.result(timeout=90)
    child = store.get_run(h3.mlflow_run_id)
    assert h3.mlflow_run_id != h1.mlflow_run_id
    assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id


@pytest.mark.slow
def test_mlflow_false_leaves_no_run_running(store):
    @distributed(processes=2, timeout=90, mlflow=False)
    def user_runs() -> None:
        import os

        import mlflow

        if os.environ["RANK"] == "0":
            mlflow.log_metric("auto", 1.0)  # auto-creates a run
        else:
            mlflow.start_run(run_name="left-open")  # never ended by the user
            mlflow.start_run(run_name="nested-open", nested=True)
            mlflow.log_metric("nested", 1.0)

    @distributed(processes=1, timeout=90, mlflow=False)
    def raises_with_run_open() -> None:
        import mlflow

        mlflow.start_run(run_name="crashing")
        mlflow.log_metric("x", 1.0)
        raise ValueError("boom")

    user_runs.distributed()
    with pytest.raises(DistributedError, match="boom"):
        raises_with_run_open.distributed()
    runs = store.search_runs([store.experiment_id])
    by_name = {r.info.run_name: r for r in runs if r.info.run_name != "user_runs"}
    assert len(runs) == 4, [(r.info.run_name, r.info.status) for r in runs]
    assert {r.info.status for r in runs} <= {"FINISHED", "FAILED"}
    assert by_name["left-open"].info.status == "FINISHED"
    assert by_name["nested-open"].info.status == "FINISHED"
    assert by_name["crashing"].info.status == "FAILED"
    assert not [r for r in runs if r.data.tags.get("gangrun.function")]  # no run of the call


# sqlite only: the rank-side end of the user's runs over REST is test_mlflow_false_* [server]
@pytest.mark.slow
@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
def test_child_runs_opened_in_ranks_end_with_their_rank(store):
    @distributed(processes=2, timeout=90)
    def children(uri: str) -> None:
        import os
        import time

        import mlflow

        rank = os.environ["RANK"]
        call_run = os.environ["MLFLOW_RUN_ID"]
        mlflow.start_run()  # resumes the call's run (MLflow's MLFLOW_RUN_ID convention)
        mlflow.start_run(run_name=f"child-{rank}", nested=True)
        mlflow.log_metric("child", 1.0)
        if rank == "0":
            return  # child-0 left open: ends FINISHED with the rank; the call's run stays
        client = mlflow.MlflowClient(tracking_uri=uri)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            done = client.search_runs(
                [client.get_run(call_run).info.experiment_id],
                "attributes.run_name = 'child-0' and attributes.status = 'FINISHED'",
            )
            if done:
                break
            time.sleep(0.1)
        print("call run after rank 0 exited:", client.get_run(call_run).info.status, flush=True)
        raise RuntimeError("rank 1 fails with child-1 open")

    h = children.submit(store.uri)
    with pytest.raises(DistributedError, match="child-1 open"):
        h.result(timeout=90)
    assert "call run after rank 0 exited: RUNNING" in h.logs(1)
    call = store.get_run(h.mlflow_run_id)
    assert call.info.status == "FAILED"
    kids = store.search_runs(
        [store.experiment_id], f"tags.mlflow.parentRunId = '{h.mlflow_run_id}'"
    )
    assert {r.info.run_name: r.info.status for r in kids} == {
        "child-0": "FINISHED",
        "child-1": "FAILED",
    }


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


@pytest.mark.parametrize("case", ["missing run", "other experiment", "missing env run"])
def test_bad_tracking_input_is_a_launch_error_before_anything_starts(
    store, tmp_path, monkeypatch, case
):
    logs = tmp_path / "logs"
    f = train.options(log_dir=str(logs))
    if case == "missing run":
        f, fragment = f.options(run_id="0" * 32), f"run_id='{'0' * 32}': no such MLflow run"
    elif case == "missing env run":
        monkeypatch.setenv("MLFLOW_RUN_ID", "f" * 32)
        fragment = f"MLFLOW_RUN_ID='{'f' * 32}': no such MLflow run"
    else:
        run = store.create_run(store.experiment_id)
        store.set_terminated(run.info.run_id)
        other = f"other-{time.time_ns()}"
        store.create_experiment(other)
        f = f.options(run_id=run.info.run_id, experiment_name=other)
        fragment = f"belongs to experiment .* not to experiment_name='{other}'"
    before = _children()
    with pytest.raises(LaunchError, match=fragment) as ei:
        f.submit(0.1, 1)
    if case != "other experiment":
        assert store.uri in str(ei.value)  # names the tracking store
    else:  # the run to resume was left as it was
        assert store.get_run(run.info.run_id).info.status == "FINISHED"
    assert not list(logs.rglob("rank-*")), "a rank started"
    assert _children() <= before, "a process started"


@pytest.mark.slow
@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
def test_system_metrics_on_by_default_for_gpu_calls(store, monkeypatch):
    from gangrun.host import accelerators
    from gangrun.host.accelerators import Accelerator

    # a mock stands in for the GPU we lack; the rank itself needs none
    fake = [Accelerator(0, "NVIDIA H100 80GB HBM3", f"GPU-tracking-{os.getpid()}")]
    monkeypatch.setattr(accelerators, "detect", lambda: fake)
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.5")

    @distributed(gpus=1, timeout=90)
    def nap() -> str:
        import os
        import time

        time.sleep(2.5)
        return os.environ["CUDA_VISIBLE_DEVICES"]

    h = nap.submit()
    assert h.result(timeout=90) == ["0"]
    metrics = store.get_run(h.mlflow_run_id).data.metrics
    assert any(k.startswith("system/cpu") for k in metrics), sorted(metrics)
    h = nap.options(log_system_metrics=False).submit()
    h.result(timeout=90)
    metrics = store.get_run(h.mlflow_run_id).data.metrics
    assert not [k for k in metrics if k.startswith("system/")], sorted(metrics)


@pytest.mark.slow
@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
def test_cli_flags(store, tmp_path):

    (tmp_path / "train.py").write_text("import mlflow\nmlflow.log_metric('x', 1.0)\n")
    exp_name = f"cli-{time.time_ns()}"

    def gangrun(*args: str) -> tuple[int, str]:
        cmd = [sys.executable, "-m", "gangrun", "run", "--processes", "2", *args, "train.py"]
        proc = run_bounded(cmd, cwd=tmp_path, timeout=120, merge_stderr=True)
        return proc.returncode, proc.stdout

    code, out = gangrun("--experiment-name", exp_name, "--run-name", "from-cli", "--tag", "k=v=w")
    assert code == 0, out
    run = store.search_runs([store.get_experiment_by_name(exp_name).experiment_id])[0]
    assert (run.info.run_name, run.data.tags["k"], run.info.status) == (
        "from-cli",
        "v=w",
        "FINISHED",
    )
    assert run.data.metrics["x"] == 1.0
    code, out = gangrun("--run-id", "0" * 32)
    assert code == 2, out
    assert f"--run-id {'0' * 32}: no such MLflow run in the tracking store {store.uri}" in out
