"""Step reports (gangrun.rank.progress, the file gangrun.wire.progress): written by the bound rank only, read back by the caller."""

from __future__ import annotations

import os

import pytest

from gangrun.rank import progress
from gangrun.wire import progress as progress_file
from gangrun.wire.rundir import RunDir


@pytest.fixture(autouse=True)
def _unbind():
    yield
    progress._bound = None
    progress._fd = None
    progress._disabled = False


def test_no_op_outside_a_rank(tmp_path):
    progress._bound = None
    progress.report_step(3, 10)
    assert progress_file.read(str(tmp_path), 0) is None


def test_report_and_read(tmp_path, monkeypatch):
    progress.bind(str(tmp_path), 1)
    clock = [1000.0]
    monkeypatch.setattr(progress.time, "time", lambda: clock[0])
    progress.report_step(0, 100)
    rep = progress_file.read(str(tmp_path), 1)
    assert rep is not None and (rep.step, rep.total, rep.resumed_from) == (0, 100, None)
    assert rep.rate is None
    # throttled: an immediate second report is not written...
    progress.report_step(1, 100)
    assert progress_file.read(str(tmp_path), 1).step == 0
    # ...but one after the interval is
    monkeypatch.setattr(progress, "_last_write", -1e9)
    clock[0] = 1010.0
    progress.report_step(50, 100)
    rep = progress_file.read(str(tmp_path), 1)
    assert rep.step == 50 and rep.rate == pytest.approx(5.0)
    assert progress_file.read_all(str(tmp_path), 2) == {1: rep}
    assert os.stat(RunDir(str(tmp_path)).progress(1)).st_size == 96


def test_resumed_and_changed_total_written_at_once(tmp_path):
    progress.bind(str(tmp_path), 0)
    progress.report_resumed(1200)
    rep = progress_file.read(str(tmp_path), 0)
    assert rep.resumed_from == 1200 and rep.step == 1200 and rep.total is None
    progress.report_step(1200, 5000)  # total changed: not throttled
    assert progress_file.read(str(tmp_path), 0).total == 5000


def test_a_fork_of_the_rank_does_not_report(tmp_path):
    progress.bind(str(tmp_path), 0)
    progress._bound = (str(tmp_path), 0, os.getpid() + 1)  # as seen from a forked child
    progress.report_step(5)
    assert progress_file.read(str(tmp_path), 0) is None


def test_garbled_file_reads_as_none(tmp_path):
    with open(RunDir(str(tmp_path)).progress(0), "w") as f:
        f.write("not a report")
    assert progress_file.read(str(tmp_path), 0) is None


def test_a_fresh_start_is_shown_but_is_not_progress(tmp_path):
    """The manager's restore that found no checkpoint (docs/restarts.md): step 0, no progress;
    the first step reported is written at once, throttle or not, as progress."""
    progress.bind(str(tmp_path), 0)
    progress.report_fresh_start()
    rep = progress_file.read(str(tmp_path), 0)
    assert rep is not None and (rep.step, rep.resumed_from, rep.progressed) == (0, None, False)
    progress.report_step(1)  # within MIN_INTERVAL_S of the last write
    rep = progress_file.read(str(tmp_path), 0)
    assert (rep.step, rep.progressed) == (1, True)


def test_a_loaded_checkpoint_is_progress(tmp_path):
    progress.bind(str(tmp_path), 0)
    progress.report_resumed(40)
    assert progress_file.read(str(tmp_path), 0).progressed


def test_a_report_without_the_progress_field_counts_as_progress(tmp_path):
    with open(RunDir(str(tmp_path)).progress(0), "w") as f:
        f.write("3 -1 -1 3 1000.0 1001.0".ljust(95) + "\n")  # as tests/fakes.py writes it
    assert progress_file.read(str(tmp_path), 0).progressed
