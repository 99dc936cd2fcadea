"""Interactive gangs (``gangrun.Gang``) with real rank processes and real gloo."""

from __future__ import annotations

import _thread
import os
import signal
import threading
import time

import psutil
import pytest

import gangrun
from conftest import assert_no_survivors, pids_alive

pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")


def _interrupt_after(seconds: float) -> threading.Timer:
    t = threading.Timer(seconds, _thread.interrupt_main)
    t.start()
    return t


def _wait_rank_file(path, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


@pytest.fixture
def g():
    gang = gangrun.Gang(processes=2, timeout=120)
    yield gang
    pids = list(gang.pids.values())
    gang.close()
    assert not pids_alive(pids)


def test_state_and_all_reduce_across_executions(capfd):
    # made here, not in a fixture: the gang streams into the sys.stdout of its start
    with gangrun.Gang(processes=2, timeout=120) as g:
        _all_reduce_cells(g, capfd)


def _all_reduce_cells(g, capfd):
    g.execute(
        "import os, torch, torch.distributed as dist, gangrun\n"
        "dist.init_process_group(gangrun.backend())\n"
        "rank = dist.get_rank()\n"
        "t = torch.ones(3) * (rank + 1)\n"
        "print('ready', rank)"
    )
    assert g.execute("dist.all_reduce(t)") == [None, None]
    assert g.execute("t.tolist()") == [[3.0, 3.0, 3.0], [3.0, 3.0, 3.0]]
    out = capfd.readouterr().out
    assert "[rank 0] ready 0" in out and "[rank 1] ready 1" in out
    # a function on the warm ranks sees the same namespace
    assert g.run(_state_sum, 10) == [19.0, 19.0]
    assert g.execute("seen") == [True, True]


def _state_sum(extra):
    ns = gangrun.rank_state()
    ns["seen"] = True
    return float(ns["t"].sum().item()) + extra


def test_exception_on_one_rank_keeps_the_gang_usable(g):
    g.execute("import os\nrank = int(os.environ['RANK'])\nkept = [rank]")
    with pytest.raises(gangrun.DistributedError) as ei:
        g.execute("kept.append(1)\nif rank == 1:\n    raise ValueError('bad value on one')\n")
    err = ei.value
    msg = str(err)
    assert isinstance(err, gangrun.GangError) and err.rank == 1 and err.ranks == [1]
    assert err.results == [None, None] and list(err.failures) == [1]  # as for a call
    assert (
        err.failures[1].exc_type == "ValueError" and err.failures[1].message == "bad value on one"
    )
    assert (err.failures[1].frame or "").startswith("<gang-cell-")
    assert "rank 1" in msg and "ValueError: bad value on one" in msg
    assert "raise ValueError('bad value on one')" in msg  # the cell's own source line
    assert "<gang-cell-" in err.traceback
    assert isinstance(err.__cause__, ValueError)
    assert g.execute("kept") == [[0, 1], [1, 1]]
    assert g.execute("rank * 2") == [0, 2]


def test_bad_input_is_refused_in_the_caller(g):
    with pytest.raises(SyntaxError):
        g.execute("x = (")
    lock = threading.Lock()
    with pytest.raises(gangrun.LaunchError, match="lock"):
        g.run(lambda: lock)
    assert g.execute("1 + 1") == [2, 2]


def test_sigkilled_rank_breaks_the_gang_and_restart_works(g, tmp_path):
    g.execute("import os, time\nrank = int(os.environ['RANK'])")
    marker = tmp_path / "started"
    pid1 = g.pids[1]
    killer = threading.Thread(
        target=lambda: (_wait_rank_file(str(marker)), os.kill(pid1, signal.SIGKILL))
    )
    killer.start()
    t0 = time.monotonic()
    with pytest.raises(gangrun.DistributedError) as ei:
        g.execute(f"open({str(marker)!r}, 'w').close()\ntime.sleep(60)")
    killer.join()
    assert time.monotonic() - t0 < 15
    msg = str(ei.value)
    assert ei.value.rank == 1 and "SIGKILL" in msg and "g.restart()" in msg, msg
    assert isinstance(ei.value, gangrun.GangError) and ei.value.rank_died
    assert ei.value.failures[1].signal == "SIGKILL", ei.value.failures
    assert not pids_alive([pid1, *g.pids.values()])
    assert_no_survivors()
    with pytest.raises(gangrun.DistributedError, match="broken.*restart"):
        g.execute("1")
    g.restart()
    assert g.execute("'rank' in dir()") == [False, False]  # fresh ranks: fresh state
    assert g.execute("2 + 2") == [4, 4]


def test_interrupt_of_sleeping_ranks_keeps_the_gang(g):
    g.execute("import time\nkeep = 7")
    t = _interrupt_after(0.8)
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        g.execute("time.sleep(60)")
    t.join()
    assert time.monotonic() - t0 < 3.5
    assert g.execute("keep") == [7, 7]


def test_interrupt_in_a_blocked_collective_returns_within_3s(g):
    g.execute(
        "import torch, torch.distributed as dist, gangrun\n"
        "dist.init_process_group(gangrun.backend())\n"
        "t = torch.ones(2)"
    )
    pids = list(g.pids.values())
    # rank 0 waits in all_reduce for a peer that waits in recv: a collective that never ends
    t = _interrupt_after(1.0)
    with pytest.raises(KeyboardInterrupt) as ei:
        g.execute("dist.all_reduce(t) if dist.get_rank() == 0 else dist.recv(t, src=0)")
    t0 = time.monotonic()
    t.join()
    # the timer fired 1 s in; the cell must be back within 3 s of it
    assert time.monotonic() - t0 < 3.0
    msg = str(ei.value)
    assert "g.restart()" in msg or "interrupted" in msg
    assert not pids_alive(pids) or g.execute("1") == [1, 1]


def test_timeout_per_execution():
    # durations as text, as GANGRUN_TIMEOUT takes them ("1s")
    with gangrun.Gang(processes=2, timeout="1s", start_timeout="2m") as g:
        assert g.timeout == 1.0 and g.start_timeout == 120.0
        g.execute("import time\nx = 5")
        t0 = time.monotonic()
        with pytest.raises(gangrun.DistributedTimeoutError):
            g.execute("time.sleep(30)")
        assert time.monotonic() - t0 < 4
        assert g.execute("x") == [5, 5]
        time.sleep(1.2)  # the gang itself has no deadline
        assert g.execute("x + 1") == [6, 6]


@pytest.mark.mlflow
def test_close_leaves_nothing_and_mlflow_run_per_gang(capfd):
    import mlflow

    g = gangrun.Gang(processes=2)
    out = capfd.readouterr().out
    assert "gangrun: MLflow run" in out  # the gang's link, printed when it starts
    run_id = g.handle.mlflow_run_id
    g.execute("import mlflow, os\nmlflow.log_metric(f\"rank{os.environ['RANK']}/x\", 1.5)")
    pids = list(g.pids.values())
    procs = [psutil.Process(p) for p in pids]
    g.close()
    g.close()  # idempotent
    psutil.wait_procs(procs, timeout=5)
    assert not pids_alive(pids)
    assert_no_survivors()
    client = mlflow.MlflowClient()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.metrics["rank1/x"] == 1.5
    with pytest.raises(gangrun.DistributedError, match="closed.*restart"):
        g.execute("1")


@pytest.mark.mlflow
def test_broken_gang_ends_its_mlflow_run_failed():
    import mlflow

    g = gangrun.Gang(processes=2)
    run_id = g.handle.mlflow_run_id
    with pytest.raises(gangrun.DistributedError, match="rank 0"):
        g.execute(
            "import os\nif os.environ['RANK'] == '0':\n    os._exit(3)\nimport time\ntime.sleep(30)"
        )
    assert mlflow.MlflowClient().get_run(run_id).info.status == "FAILED"
    g.close()


def test_gang_closed_at_interpreter_exit(script):
    p = script(
        """
        import gangrun, os
        g = gangrun.Gang(processes=2)
        print(*g.pids.values(), flush=True)
        g.execute("x = 1")
        """
    )
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    pids = [int(x) for x in out.split()]
    assert len(pids) == 2
    time.sleep(0.2)
    assert not pids_alive(pids)
    assert_no_survivors(p.pid)


@pytest.mark.mlflow
def test_gang_open_at_exit_ends_its_mlflow_run_finished(script):
    """One ordered shutdown (lifecycle/calls.py): the open gang closes first (FINISHED, as
    docs/interactive.md promises), before the exit hook cancels active calls (KILLED)."""
    import mlflow

    p = script(
        """
        import gangrun
        g = gangrun.Gang(processes=2)
        print(g.handle.mlflow_run_id, *g.pids.values(), flush=True)
        g.execute("x = 1")
        """
    )
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    run_id, *pids = out.split()[-3:]
    time.sleep(0.2)
    assert not pids_alive([int(x) for x in pids])
    assert_no_survivors(p.pid)
    assert mlflow.MlflowClient().get_run(run_id).info.status == "FINISHED"
