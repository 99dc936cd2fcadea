"""max_restarts resumes from the function's own checkpoint; the stuck-rank guard."""

from __future__ import annotations

import time

import pytest
import rel_funcs

import gangrun
from gangrun import DistributedError, DistributedHangError

pytestmark = pytest.mark.slow


def test_restart_after_rank_killed_mid_training_matches_uninterrupted(tmp_path, capfd):
    steps = 6
    clean_dir, faulty_dir = tmp_path / "clean", tmp_path / "faulty"
    clean_dir.mkdir()
    faulty_dir.mkdir()
    fn = gangrun.distributed(processes=2, timeout=180, max_restarts=1)(rel_funcs.train)
    clean = fn.distributed(str(clean_dir), steps, None)
    assert [r["attempt"] for r in clean] == [0, 0]
    h = fn.submit(str(faulty_dir), steps, 3)
    resumed = h.result(timeout=180)
    assert [r["attempt"] for r in resumed] == [1, 1]  # TORCHELASTIC_RESTART_COUNT
    assert [r["start"] for r in resumed] == [3, 3]  # resumed from its checkpoint, not from 0
    assert [r["params"] for r in resumed] == [r["params"] for r in clean]  # same final model
    assert resumed[0]["params"] == resumed[1]["params"]
    err = capfd.readouterr().err
    assert "Rank 1" in err and "SIGKILL" in err and "restart 1/1" in err
    assert "resuming from step 3 (attempt 1)" in h.logs(0)


def test_restarts_exhausted_reports_the_last_failure(capfd):
    fn = gangrun.distributed(processes=2, timeout=120, max_restarts=2, restart_backoff=0.1)(
        rel_funcs.always_fail
    )
    with pytest.raises(DistributedError, match="attempt 2 failed") as ei:
        fn.distributed()
    assert isinstance(ei.value.__cause__, ConnectionResetError)
    assert "3 attempts ran (max_restarts=2); restarts stopped: max_restarts=2" in str(ei.value)
    err = capfd.readouterr().err
    assert "restart 1/2" in err and "restart 2/2" in err


def test_hang_verdict_names_the_rank_holding_the_collective_with_stacks():
    fn = gangrun.distributed(processes=2, timeout=120, hang_timeout=4.0)(
        rel_funcs.stuck_in_collective
    )
    t0 = time.monotonic()
    with pytest.raises(DistributedHangError) as ei:
        fn.distributed()
    took = time.monotonic() - t0
    err = ei.value
    assert isinstance(err, TimeoutError)
    assert took < 4.0 + 15.0  # startup (torch import) + hang_timeout + dump, not the 120 s timeout
    assert err.ranks == [1] and err.rank == 1  # the sleeping rank, not the one waiting for it
    assert "all_reduce" in err.stacks[0]  # where rank 0 waits
    assert "stuck_in_collective" in err.stacks[1] or "rel_funcs.py" in err.stacks[1]
    assert "has not entered it and makes no progress" in str(err) and "all_reduce #1" in str(err)


@pytest.mark.parametrize("how", ["heartbeat", "print"])
def test_hang_guard_leaves_progressing_ranks_alone(how):
    fn = gangrun.distributed(processes=2, timeout=60, hang_timeout=1.0)(rel_funcs.quiet_but_beating)
    counts = fn.distributed(3.0, how)
    assert all(c > 10 for c in counts)


def test_heartbeat_is_a_noop_outside_a_rank():
    gangrun.heartbeat()
