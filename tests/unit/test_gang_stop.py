"""`ProcessGang`'s teardown on fake ranks (``tests/fakes.py``): SIGTERM, the grace period,
SIGKILL of what is left, the ``GANGRUN_RUN_ID`` sweep, what is released and closed. No
processes: the real gang code runs over a `FakeSpawner`."""

from __future__ import annotations

import os
import signal

import pytest

from fakes import FakeSpawner, fake_process_gang
from gangrun.errors import LaunchError
from gangrun.host import system as platform
from gangrun.wire.rundir import RunDir

TERM, KILL = signal.SIGTERM, signal.SIGKILL


@pytest.fixture
def sweeps(monkeypatch):
    """The sweeps the gang asks for, in order with the signals (through the spawner's log)."""
    logs: list[list[tuple]] = []

    def sweep(run_id, since_ticks=0, sig=KILL):
        for log in logs:
            log.append(("sweep", run_id))
        return []

    monkeypatch.setattr(platform, "sweep", sweep)
    return logs


def _open_fds() -> set[int]:
    return {int(fd) for fd in os.listdir("/proc/self/fd")}


def test_ranks_that_honour_sigterm_end_by_it_then_the_tree_is_killed_and_swept(tmp_path, sweeps):
    sp = FakeSpawner()
    sweeps.append(sp.log)
    fg = fake_process_gang(tmp_path, sp, n=2, grace=30.0)
    assert sorted(fg.gang.alive()) == [0, 1] and fg.pump.started
    fg.gang.stop()
    exits = fg.collect()
    assert {r: e.exitcode for r, e in exits.items()} == {0: -TERM, 1: -TERM}
    assert fg.gang.alive() == []
    # SIGTERM to every tree, then SIGKILL to every tree (leftover descendants), then the sweep
    assert sp.log == [
        ("signal", 0, TERM),
        ("signal", 1, TERM),
        ("signal", 0, KILL),
        ("signal", 1, KILL),
        ("sweep", fg.spec.run_id),
    ]
    assert os.path.exists(RunDir(fg.spec.run_dir).stop_teardown)  # "this TERM is teardown"
    fg.close()


def test_a_rank_that_ignores_sigterm_is_killed_after_the_grace_period(tmp_path, sweeps):
    sp = FakeSpawner(survives_term=[1])
    sweeps.append(sp.log)
    fg = fake_process_gang(tmp_path, sp, n=2, grace=0.2)
    fg.gang.stop()
    exits = fg.collect()
    assert exits[0].exitcode == -TERM and exits[1].exitcode == -KILL
    assert sp.ranks[1].signals == [TERM, KILL]
    assert sp.log[-1] == ("sweep", fg.spec.run_id)
    fg.close()


def test_stop_after_every_rank_ended_sends_no_sigterm_but_still_kills_and_sweeps(tmp_path, sweeps):
    sp = FakeSpawner()
    sweeps.append(sp.log)
    fg = fake_process_gang(tmp_path, sp, n=2)
    sp.ranks[0].end(0)
    sp.ranks[1].end(3)
    assert {r: e.exitcode for r, e in fg.collect().items()} == {0: 0, 1: 3}
    fg.gang.stop()
    assert [e for e in sp.log if e[0] == "signal" and e[2] == TERM] == []
    assert sp.log[-1] == ("sweep", fg.spec.run_id)
    assert [e for e in sp.log if e[0] == "signal"] == [("signal", 0, KILL), ("signal", 1, KILL)]
    assert not os.path.exists(RunDir(fg.spec.run_dir).stop_teardown)
    fg.close()


def test_signal_rank_reaches_that_rank_only(tmp_path, sweeps):
    sp = FakeSpawner(survives_term=[0, 1])
    fg = fake_process_gang(tmp_path, sp, n=2)
    fg.gang.signal_rank(1, signal.SIGINT)
    fg.gang.signal_rank(7, signal.SIGINT)  # no such rank: nothing happens
    assert sp.ranks[0].signals == [] and sp.ranks[1].signals == [signal.SIGINT]
    fg.gang.stop(grace=0.0)
    fg.collect()
    fg.close()


def test_close_releases_the_spawner_once_and_every_pipe(tmp_path, sweeps):
    before = _open_fds()
    sp = FakeSpawner()
    fg = fake_process_gang(tmp_path, sp, n=3)
    fg.gang.stop(grace=0.0)
    fg.collect()
    fg.close()
    fg.gang.close()  # twice: nothing more
    assert sp.released == [0.0]
    assert _open_fds() <= before  # liveness pipe, rank pipes, log files


def test_a_failed_start_releases_the_spawner_and_leaks_no_descriptor(tmp_path, sweeps):
    before = _open_fds()
    sp = FakeSpawner(fail=LaunchError("no room"))
    fg = fake_process_gang(tmp_path, sp, n=2, start=False)
    with pytest.raises(LaunchError, match="no room"):
        fg.gang.start()
    assert sp.released == [0.0] and fg.gang.alive() == []
    fg.gang.stop()  # what the supervisor does after a failed start
    fg.close()
    assert sp.released == [0.0]  # once
    assert _open_fds() <= before


def test_a_spawner_that_fails_to_wait_still_reports_the_rank_as_killed(tmp_path, sweeps):
    sp = FakeSpawner(wait_errors={1: OSError("wait failed")}, lost={0: "its fork server died"})
    fg = fake_process_gang(tmp_path, sp, n=2)
    assert fg.collect(1)[1].exitcode == -KILL  # the wait that raised ends the rank's wait
    sp.ranks[0].end(-KILL)
    exits = fg.collect()
    assert exits[0].lost == "its fork server died"  # the launcher's word travels with the exit
    fg.gang.stop()
    fg.close()
