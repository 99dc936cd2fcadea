"""What a call's lifecycle guarantees at its edges: stale run directories reaped only when
provably dead, a monitor failure still finishing the call, forked children of the caller,
the error record deciding a rank's outcome, the ranks' ``PYTHONPATH``, an early clean exit as
the root cause, bad input refused before anything starts, and an unprintable exception."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import rel_funcs

import gangrun
from gangrun import DistributedError, LaunchError
from gangrun.host.system import process_identity

HERE = Path(__file__).resolve().parent


def _fn(func, **kw):
    kw.setdefault("processes", 2)
    kw.setdefault("timeout", 90)
    return gangrun.distributed(**kw)(func)


def _run_dirs(tmp: Path) -> list[Path]:
    return sorted(p for p in tmp.iterdir() if p.name.startswith("gangrun-"))


def _dead_identity() -> str:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    ident = process_identity(p.pid)
    p.wait(30)
    return ident or f"{p.pid}:1"


def _plant(tmp: Path, name: str, **ctx) -> Path:
    d = tmp / name
    d.mkdir(mode=0o700)
    (d / "context.json").write_text(json.dumps({"sys_path": [], "cwd": "/", **ctx}))
    return d


def test_stale_reaping_only_for_this_host_and_pid_namespace(script, tmp_path):
    """A run directory whose caller lived in another PID namespace (another
    container) or on another host sharing the temp dir is never reaped; one provably dead
    here is. The other namespace/host is simulated by writing their ids into context.json."""
    tmp = tmp_path / "tmp"
    tmp.mkdir(mode=0o700)
    dead = _dead_identity()
    host = socket.gethostname()
    ns = os.readlink("/proc/self/ns/pid")
    other_ns = _plant(tmp, "gangrun-otherns-x", caller=dead, host=host, pid_ns="pid:[1]")
    other_host = _plant(tmp, "gangrun-otherhost-x", caller=dead, host="elsewhere", pid_ns=ns)
    here = _plant(tmp, "gangrun-deadhere-x", caller=dead, host=host, pid_ns=ns)
    proc = script(
        f"""
        import sys; sys.path.insert(0, {str(HERE)!r})
        import gangrun, rel_funcs
        f = gangrun.distributed(processes=1, timeout=60)(rel_funcs.tagged)
        print("RESULT", [r["tag"] for r in f.distributed("a", 0.0)])
        """,
        env={"TMPDIR": str(tmp)},
    )
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "RESULT ['a']" in out
    assert other_ns.exists(), "a live call of another PID namespace was reaped"
    assert other_host.exists(), "a live call of another host was reaped"
    assert not here.exists()


def test_monitor_failure_still_finishes_the_call(monkeypatch):
    """An exception while tearing the call down (clearing the attempt files raises)
    must not leave the call unfinished: every exit path settles the outcome."""
    real = os.listdir

    def failing_listdir(path="."):
        if isinstance(path, str) and os.path.exists(os.path.join(path, "context.json")):
            raise PermissionError(13, "injected failure", path)
        return real(path)

    monkeypatch.setattr(os, "listdir", failing_listdir)
    h = _fn(rel_funcs.tagged).submit("t", 0.0)
    res = h.result(timeout=60)  # a dead monitor thread would leave it waiting
    assert [r["tag"] for r in res] == ["t", "t"]
    assert h.done()


def test_forked_child_exits_at_once_and_leaves_the_call_alone(script):
    """A forked child of the caller exiting with sys.exit(0) exits at once (its atexit hooks
    do not cancel the parent's calls from the child) and the parent's call runs on to its
    result."""
    proc = script(
        f"""
        import os, sys, time
        sys.path.insert(0, {str(HERE)!r})
        import gangrun, rel_funcs
        f = gangrun.distributed(processes=2, timeout=60)(rel_funcs.tagged)
        h = f.submit("p", 2.0)
        t = time.monotonic()
        pid = os.fork()
        if pid == 0:
            sys.exit(0)
        os.waitpid(pid, 0)
        print("CHILD", round(time.monotonic() - t, 2))
        print("RESULT", [r["tag"] for r in h.result(timeout=60)])
        """
    )
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    child = float(out.split("CHILD ")[1].split()[0])
    assert child < 3.0, f"the forked child took {child}s to exit"
    assert "RESULT ['p', 'p']" in out


def test_error_record_is_authoritative_with_sigchld_ignored(script):
    """With SIGCHLD ignored every exit status reads 0, and rank 1 raised: the error record
    decides, the call fails blaming rank 1 (never returns [0, None])."""
    proc = script(
        f"""
        import signal, sys
        sys.path.insert(0, {str(HERE)!r})
        signal.signal(signal.SIGCHLD, signal.SIG_IGN)
        import gangrun, rel_funcs
        f = gangrun.distributed(processes=2, timeout=60, start_method="spawn")(
            rel_funcs.raise_on_rank1
        )
        try:
            print("RESULT", f.distributed())
        except gangrun.DistributedError as e:
            print("ERR", e.rank, e.exc_type, sorted(e.failures))
        """
    )
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "ERR 1 ValueError [1]" in out, out


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_no_result_and_no_error_is_a_failure(start_method):
    """A rank that ends with neither a result nor an error record (os._exit(0))
    is a failure, never a ``None`` result."""
    with pytest.raises(DistributedError) as ei:
        _fn(rel_funcs.os_exit0_on_rank1, start_method=start_method).distributed()
    assert ei.value.rank == 1 and ei.value.exitcode == 0
    assert "exited with code 0 before returning" in str(ei.value)
    assert set(ei.value.failures) == {1}


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_env_pythonpath_is_added_first(tmp_path, start_method):
    """env={"PYTHONPATH": dir} is not replaced by the caller's sys.path: the ranks get the
    caller's sys.path plus PYTHONPATH's entries, those first."""
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "lc_only_here.py").write_text("VALUE = 42\n")
    res = _fn(
        rel_funcs.import_by_name, env={"PYTHONPATH": str(mods)}, start_method=start_method
    ).distributed("lc_only_here")
    assert [r["value"] for r in res] == [42, 42]
    assert all(r["path"][0] == str(mods) for r in res)


def test_early_exit_zero_is_the_root_cause():
    """Rank 1 leaves with sys.exit(0) while rank 0 waits for it in all_reduce: rank 1 is the
    root cause, not rank 0's "Connection reset by peer"."""
    pytest.importorskip("torch")
    with pytest.raises(DistributedError) as ei:
        _fn(rel_funcs.exit0_during_all_reduce).distributed()
    e = ei.value
    assert e.rank == 1, str(e)
    assert "Rank 1" in str(e).splitlines()[0]
    assert "exited with code 0 before returning" in str(e).splitlines()[0]
    assert 1 in e.failures and e.failures[1].exitcode == 0


def test_deleted_working_directory_is_a_launch_error(script, tmp_path):
    """With the working directory deleted, a call raises a LaunchError that says so (not a
    raw FileNotFoundError) and leaves no run directory behind."""
    tmp = tmp_path / "tmp"
    tmp.mkdir(mode=0o700)
    proc = script(
        f"""
        import os, sys
        sys.path.insert(0, {str(HERE)!r})
        import gangrun, rel_funcs
        os.mkdir("gone"); os.chdir("gone"); os.rmdir(os.path.abspath("."))
        f = gangrun.distributed(processes=2, timeout=60)(rel_funcs.tagged)
        try:
            f.distributed("x", 0.0)
        except gangrun.LaunchError as e:
            print("LAUNCH", e)
        """,
        env={"TMPDIR": str(tmp)},
    )
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "LAUNCH" in out and "working directory" in out
    assert _run_dirs(tmp) == []


def test_pathlib_path_in_sys_path_works_and_leaves_nothing(monkeypatch, tmp_path):
    """A pathlib.Path in sys.path works (no raw TypeError, "not JSON serializable") and
    leaves no run directory with a partial context.json."""
    tmp = tmp_path / "tmp"
    tmp.mkdir(mode=0o700)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    monkeypatch.setattr(sys, "path", [*sys.path, tmp_path / "extra"])
    h = _fn(rel_funcs.tagged).submit("pp", 0.0)
    assert [r["tag"] for r in h.result(timeout=60)] == ["pp", "pp"]
    del h
    import gc

    gc.collect()
    assert _run_dirs(tmp) == []


def test_any_startup_failure_cleans_up(monkeypatch, tmp_path):
    """Any start-up failure (here: the payload cannot be written) leaves nothing."""
    tmp = tmp_path / "tmp"
    tmp.mkdir(mode=0o700)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    with pytest.raises(LaunchError):
        _fn(rel_funcs.tagged, max_capture_bytes=16).distributed("x" * 1000, 0.0)
    assert _run_dirs(tmp) == []


def test_exception_whose_str_raises_is_reported():
    """An exception whose __str__ raises is reported with its type and traceback and a note
    for the message (not as "exited with code 70 without a Python exception")."""
    with pytest.raises(DistributedError) as ei:
        _fn(rel_funcs.raise_unprintable, processes=1).distributed()
    e = ei.value
    assert e.exc_type == "rel_funcs.UnprintableError"
    assert "could not be rendered" in str(e).splitlines()[0]
    assert "raise_unprintable" in (e.traceback or "")
    assert e.exitcode == 1


@pytest.mark.parametrize("where", ["mkdtemp", "create"])
def test_ctrl_c_just_after_the_run_directory_is_made_leaves_none(where, monkeypatch, tmp_path):
    """Soak (CI seed) run 783: Ctrl-C 7 ms into a call landed between the run directory's
    creation and the call keeping it; the directory was left for good. The interrupt is
    raised here at those two points: inside `rundir.create` just after `mkdtemp`, and just
    after `create` returned to the supervisor."""
    from gangrun.lifecycle import supervisor
    from gangrun.wire import rundir

    tmp = tmp_path / "tmp"
    tmp.mkdir(mode=0o700)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    if where == "mkdtemp":
        real_mkdtemp = tempfile.mkdtemp

        def interrupted_mkdtemp(*a, **kw):
            real_mkdtemp(*a, **kw)
            raise KeyboardInterrupt

        monkeypatch.setattr(rundir.tempfile, "mkdtemp", interrupted_mkdtemp)
    else:
        real_create = supervisor.create

        def interrupted_create(*a, **kw):
            real_create(*a, **kw)
            raise KeyboardInterrupt

        monkeypatch.setattr(supervisor, "create", interrupted_create)
    with pytest.raises(KeyboardInterrupt):
        _fn(rel_funcs.tagged).distributed("x", 0.0)
    monkeypatch.undo()
    assert _run_dirs(tmp) == []
    tmp.mkdir(mode=0o700, exist_ok=True)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    assert [r["tag"] for r in _fn(rel_funcs.tagged).distributed("y", 0.0)] == ["y", "y"]


@pytest.mark.mlflow
def test_ctrl_c_just_after_the_mlflow_run_is_made_ends_it(monkeypatch, tmp_path):
    """Ctrl-C after the call's MLflow run was created but before the call holds it (here:
    while the run's link is printed) ended nothing: the run stayed RUNNING in the store for
    good. Now it ends KILLED, and nothing of the call is left."""
    from mlflow import MlflowClient

    from gangrun.tracking import caller

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    tmp = tmp_path / "tmp"
    tmp.mkdir(mode=0o700)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))

    def interrupted_link(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(caller, "run_link", interrupted_link)
    with pytest.raises(KeyboardInterrupt):
        _fn(rel_funcs.tagged, experiment_name="ctrl-c").distributed("x", 0.0)
    monkeypatch.undo()
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("ctrl-c")
    runs = client.search_runs([exp.experiment_id])
    assert [r.info.status for r in runs] == ["KILLED"]
    assert _run_dirs(tmp) == []
