"""Where a rank's exit becomes an error: `rootcause.rank_failure`, and every special case that
goes through it — the fork server's death, a lost Ray actor, a spawner whose wait failed, an
interactive gang's execution that raised — each fed from the code that makes it."""

from __future__ import annotations

import pickle
import queue
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from gangrun import DistributedError, GangError
from gangrun.interactive.outcome import PerRank, failure
from gangrun.launch import GangSpec, LostRank, RankExit, RankSpec
from gangrun.launch.forkserver.spawner import RESTART_HINT, server_death
from gangrun.launch.gang import ProcessGang
from gangrun.launch.ray.records import NodeInfo
from gangrun.launch.ray.spawner import lost_actor
from gangrun.lifecycle.collect import RankFiles
from gangrun.lifecycle.policy import is_transient_exception
from gangrun.lifecycle.rootcause import rank_failure
from gangrun.wire.records import ErrorRecord, RankFailure
from gangrun.wire.rundir import RunDir
from gangrun.wire.serialization import atomic_dump

SIGKILL = -signal.SIGKILL


def _files(tmp_path, world_size=2) -> RankFiles:
    (tmp_path / "logs").mkdir(exist_ok=True)
    return RankFiles(RunDir(str(tmp_path)), world_size, "run1", grace=1.0)


# ------------------------------------------------------------------ the plain cases
def test_a_record_is_authoritative_whatever_the_exit_status():
    rec = ErrorRecord(1, "ValueError", "bad", "Traceback...\nValueError: bad\n", 5.0, frame="t:3")
    f = rank_failure(1, RankExit(1, 0, 9.0), rec)  # exit 0: a caller ignoring SIGCHLD
    assert f == RankFailure(1, 1, None, "ValueError", "bad", rec.traceback, 5.0, "t:3")
    assert not f.is_clean_exit


def test_sys_exit_0_before_returning_is_a_clean_failure():
    rec = ErrorRecord(0, "SystemExit", "0", "", 2.0, exitcode=0)
    f = rank_failure(0, RankExit(0, 0, 3.0), rec)
    assert f is not None and f.is_clean_exit
    assert f.message == "exited with code 0 before returning" and f.exitcode == 0


@pytest.mark.parametrize(
    "code, has_result, message",
    [
        (0, True, None),
        (0, False, "exited with code 0 before returning"),
        (3, True, "exited with code 3"),
        (SIGKILL, False, "killed by SIGKILL"),
    ],
)
def test_without_a_record_the_exit_decides(code, has_result, message):
    f = rank_failure(1, RankExit(1, code, 7.0), None, has_result)
    if message is None:
        assert f is None
    else:
        assert f is not None and f.message == message and f.exitcode == code and f.time == 7.0
        assert f.signal == ("SIGKILL" if code == SIGKILL else None) and f.exc_type is None


def test_the_running_call_and_its_root_cause_read_the_same_function(tmp_path):
    files = _files(tmp_path)
    rec = ErrorRecord(1, "ValueError", "bad", "tb\n", 1.0)
    atomic_dump(rec, files.rundir.error(1))
    atomic_dump(0, files.rundir.result(0))
    exits = {0: RankExit(0, 0, 2.0), 1: RankExit(1, 1, 1.5)}
    assert not files.exit_failed(exits[0]) and files.exit_failed(exits[1])
    err = files.root_cause(exits, exits[1], teardown_at=3.0, pids={0: 10, 1: 11})
    assert err.rank == 1 and err.exc_type == "ValueError"
    assert err.failures == {1: rank_failure(1, exits[1], rec)}


def test_a_record_of_another_type_is_no_record(tmp_path):
    """Every writer writes an `ErrorRecord`; a dict (the old Ray writer) is not read as one."""
    files = _files(tmp_path)
    atomic_dump({"rank": 0, "exc_type": "X"}, files.rundir.error(0))
    assert files.record(0) is None
    assert ErrorRecord.coerce({"rank": 0}) is None


# ------------------------------------------------------------------ the fork server died
def test_fork_server_death_is_no_rank_s_fault(tmp_path):
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    server.kill()
    server.wait(10)
    lost = server_death(SimpleNamespace(proc=server, pid=server.pid))
    assert lost == LostRank(
        f"the fork server (pid {server.pid}) died (killed by SIGKILL)", hint=RESTART_HINT
    )
    assert server_death(None).why == "the fork server died"
    exits = {r: RankExit(r, SIGKILL, 1.0 + r, lost) for r in (0, 1)}
    f = rank_failure(0, exits[0], None)
    assert f is not None and f.message == lost.why and f.signal == "SIGKILL"
    err = _files(tmp_path).root_cause(exits, exits[0], teardown_at=5.0, pids={})
    msg = str(err)
    assert err.rank is None and err.failures == {}, msg
    assert msg.startswith(f"The fork server (pid {server.pid}) died (killed by SIGKILL)"), msg
    assert RESTART_HINT in msg


# ------------------------------------------------------------------ a Ray actor was lost
def test_lost_ray_actor_is_its_rank_s_failure_naming_the_node(tmp_path):
    nodes = {
        0: NodeInfo("node-a" * 4, "10.0.0.1"),
        1: NodeInfo("node-b" * 4, "10.0.0.2"),
        2: NodeInfo("node-b" * 4, "10.0.0.2"),
    }
    lost = lost_actor(1, nodes, RuntimeError("actor died"))
    assert not lost.launcher and lost.exc_type == "ray.RuntimeError"
    assert "ranks [1, 2] ran on that node" in lost.why and "Ray said: actor died" in lost.detail
    exits = {0: RankExit(0, SIGKILL, 2.0), 1: RankExit(1, 1, 1.0, lost), 2: RankExit(2, 1, 1.1)}
    f = rank_failure(1, exits[1], None)
    assert f == RankFailure(1, 1, None, "ray.RuntimeError", lost.why, lost.detail, 1.0)
    assert is_transient_exception(f.exc_type or "", f.message)  # restarted, not given up
    err = _files(tmp_path, 3).root_cause(exits, exits[1], teardown_at=1.5, pids={1: 77})
    msg = str(err)
    assert err.rank == 1 and err.exc_type == "ray.RuntimeError", msg
    assert msg.startswith("Rank 1 (pid 77) failed: ray.RuntimeError: the Ray actor"), msg
    assert "Ray said: actor died" in msg and err.traceback == lost.detail


# ------------------------------------------------------------------ the gang's waiter failed
class _BrokenWait:
    """A spawner's rank whose ``wait`` raises (a bug in the spawner)."""

    pid = 4242
    lost = node = None

    def wait(self) -> int:
        raise RuntimeError("status pipe in a bad state")

    def signal(self, sig: int) -> None:
        pass


def test_a_wait_that_raised_is_reported_as_a_lost_rank(tmp_path):
    events: queue.Queue = queue.Queue()
    spec = GangSpec("run1", str(tmp_path), [RankSpec(0, {})], str(tmp_path / "logs"))
    gang = ProcessGang(spec, None, events, spawner=None)  # type: ignore[arg-type]
    gang._watch(0, _BrokenWait())
    ev = events.get(timeout=10)
    assert ev.exitcode == SIGKILL and ev.lost is not None and ev.lost.launcher
    assert "waiting for rank 0 failed (RuntimeError: status pipe in a bad state)" in ev.lost.why
    f = rank_failure(0, ev, None)
    assert f is not None and f.message == ev.lost.why
    err = _files(tmp_path, 1).root_cause({0: ev}, ev, teardown_at=time.time(), pids={})
    assert err.rank is None and "a bug in gangrun" in str(err)


# ------------------------------------------------------------------ an interactive gang
def test_gang_execution_errors_carry_each_rank_s_failure():
    exc = pickle.dumps(ValueError("bad value"))
    rec = ErrorRecord(1, "ValueError", "bad value", "tb one\n", 3.0, exc=exc, frame="c:2")
    values = PerRank([10, None, 30])
    err = failure({1: rec}, values, "the execution", "run1")
    assert isinstance(err, GangError) and isinstance(err, DistributedError)
    assert err.rank == 1 and err.ranks == [1] and err.results == [10, None, 30]
    assert err.failures == {1: rank_failure(1, None, rec)}
    assert err.failures[1].exitcode is None and err.failures[1].frame == "c:2"
    assert isinstance(err.__cause__, ValueError)
    back = pickle.loads(pickle.dumps(err))
    assert (back.ranks, back.results, back.failures) == (err.ranks, err.results, err.failures)
    assert not back.rank_died and not back.before_start
