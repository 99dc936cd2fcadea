"""Progress, ETA, slow and silent ranks, the chart grid, the node's call records (no ranks:
pure functions and the run-directory files, with a timeline given by the test)."""

from __future__ import annotations

import io
import json
import os
import re
import sys
import tempfile
import types

import pytest

from gangrun.cli.node import CallRef, Unknown, find_calls, resolve
from gangrun.cli.status import ClearingStream, StatusLine, start
from gangrun.lifecycle import watch
from gangrun.lifecycle.control import RECORD
from gangrun.notebook import charts, html
from gangrun.notebook.state import CallState
from gangrun.progress_view import Progress, RankProgress, summary_line
from gangrun.rank import progress
from gangrun.tracking.plan import run_link
from gangrun.wire.progress import StepReport, read


def rep(rank, step, t, total=1000, first=(0, 0.0)):
    return StepReport(rank, step, total, None, first[0], first[1], t)


def test_slow_rank_marked_after_the_window_with_its_ratio(monkeypatch):
    monkeypatch.setenv("GANGRUN_SLOW_AFTER", "5")
    tr = watch.ProgressTracker(2)
    p = None
    for t in range(1, 12):  # rank 0: 10 steps/s, rank 1: 2 steps/s
        p = tr.update({0: rep(0, 10 * t, t), 1: rep(1, 2 * t, t)}, now=float(t))
        if t < 6:
            assert p.slow == {}, t  # below the others' median, but not for 5 s yet
    assert p is not None and set(p.slow) == {1}
    assert p.slow[1] == pytest.approx(0.2, rel=0.05)
    assert p.step == 22 and p.total == 1000  # the gang is as far as its slowest rank
    assert p.eta_s == pytest.approx((1000 - 22) / 2, rel=0.05)  # that rank's own rate
    assert "slow: rank 1 (0.20x)" in summary_line(p) and "ETA" in summary_line(p)
    # rank 1 keeps pace again: the mark goes once its recent rate is back
    for t in range(12, 40):
        p = tr.update({0: rep(0, 110 + 10 * (t - 11), t), 1: rep(1, 22 + 10 * (t - 11), t)}, t)
    assert p.slow == {}


def test_nothing_reported_nothing_guessed():
    tr = watch.ProgressTracker(2)
    p = tr.update({}, now=10.0)
    assert not p.reported and p.eta_s is None and summary_line(p) == ""
    p = tr.update({0: rep(0, 5, 2.0, total=None)}, now=2.0)
    assert p.reported and p.total is None and p.eta_s is None  # no total: no ETA
    assert summary_line(p).startswith("step 5 ·")


def test_silent_rank_marked(monkeypatch):
    monkeypatch.setenv("GANGRUN_SILENT_AFTER", "30")
    tr = watch.ProgressTracker(2)
    p = tr.update({}, now=100.0, last_progress={0: 95.0, 1: 60.0})
    assert p.silent == {1: 40.0} and not p.reported
    assert "rank 1" in summary_line(Progress(step=3, ranks=p.ranks))


def test_a_new_attempt_starts_its_rates_afresh():
    tr = watch.ProgressTracker(1)
    tr.update({0: rep(0, 100, 10.0)}, 10.0)
    p = tr.update({0: rep(0, 5, 21.0, first=(0, 20.0))}, 21.0)  # first_time changed
    assert p.ranks[0].rate == pytest.approx(5.0)


def test_flush_writes_the_report_the_throttle_held_back(tmp_path):
    progress.bind(str(tmp_path), 0)
    progress.report_step(1, 10)
    progress.report_step(10, 10)  # within MIN_INTERVAL_S: held back
    assert read(str(tmp_path), 0).step == 1
    progress.flush()
    assert read(str(tmp_path), 0).step == 10


def test_aggregate_merges_ranks_per_step_and_caps_points():
    agg = charts.aggregate([(0, 1.0), (0, 3.0), (1, 2.0), (1, float("nan"))])
    assert agg == [(0.0, 2.0, 1.0, 3.0), (1.0, 2.0, 2.0, 2.0)]
    many = charts.aggregate([(s, float(s)) for s in range(10_000)])
    assert len(many) <= charts.MAX_POINTS and many[-1][0] == 9999
    assert min(p[2] for p in many) == 0 and max(p[3] for p in many) == 9999


def test_grid_one_chart_per_metric_own_axes_band_and_cap():
    series = {
        "loss": [(s, 1.0 + 0.1 * r) for s in range(50) for r in (0, 1)],  # 2 ranks, same key
        "total": [(e, 1000.0 + e) for e in range(3)],  # once per epoch
    }
    out = html.svg_chart(series)
    assert out.count('class="gangrun-metric"') == 2
    loss = out[out.index('data-metric="loss"') : out.index('data-metric="total"')]
    assert 'data-band="1"' in loss and 'data-points="50"' in loss
    assert loss.count("<polyline") == 1 and "<polygon" in loss  # one mean line, one band
    total = out[out.index('data-metric="total"') :]
    assert 'data-band="0"' in total and total.count("<circle") == 3  # markers: few points
    assert 'data-y-min="1000" data-y-max="1002"' in total  # own y ranges
    assert 'data-y-min="1" data-y-max="1.1"' in loss
    many = {f"m{i:02d}": [(0, float(i))] for i in range(charts.MAX_CHARTS + 3)}
    out = html.svg_chart(many, {"extra": 7.0})
    assert out.count('class="gangrun-metric"') == charts.MAX_CHARTS
    assert "more: " in out and "m14 14" in out and "extra 7" in out
    assert html.svg_chart({}) == ""


def test_panel_shows_progress_slow_and_silent_marks():
    call = types.SimpleNamespace(fn_name="train", run_id="r1", world_size=2, max_restarts=0)
    st = CallState(call)
    st.starting()
    st.attempt_started(0)
    p = Progress(
        step=40,
        total=100,
        rate=4.0,
        eta_s=15.0,
        ranks={
            0: RankProgress(0, 90, 100, 10.0),
            1: RankProgress(1, 40, 100, 2.0, slow_ratio=0.2, silent_for=300.0,
                            slow_cause="its peers wait for it 38% of their step in all_reduce "
                            "at train.py:52"),
        },
    )  # fmt: skip
    out = html.render_panel(st.snapshot, progress=p)
    assert "slow 0.20x</span> (its peers wait for it 38% of their step in all_reduce" in out
    assert 'class="gangrun-progress">step 40/100 (40%) · 4 steps/s · ETA 15s' in out
    assert 'data-rank="1" data-state="running" data-slow="0.20" data-silent="300"' in out
    assert "slow 0.20x" in out and "handle.stacks()" in out
    assert "data-slow" not in out.split('data-rank="1"')[0]  # rank 0 is fine
    st.ended("FINISHED")
    final = html.render_panel(st.snapshot, progress=p)
    assert "ETA" not in final and "data-silent" not in final  # frozen: no live guesses
    assert html.header_lines(st.snapshot)[0].startswith("<b>train</b>")


def test_a_slow_rank_says_why_from_the_collective_record():
    from gangrun.lifecycle.verdict import slow_cause
    from gangrun.progress_view import summary_line
    from gangrun.wire.collectives import OpRecord, RingView

    def ring(rank, spans):  # (entered, left) of all_reduce at train.py:52, one per step
        recs = tuple(
            OpRecord("all_reduce", "world", i + 1, -1, 4, "float32[4]", "/w/train.py:52", a, b)
            for i, (a, b) in enumerate(spans)
        )
        return RingView(rank, 1, len(recs), recs)

    # 10 steps of 1 s: rank 1 computes 0.9 s and syncs 0.1 s; ranks 0 and 2 compute 0.5 s and
    # then wait 0.5 s for it in the all_reduce (over the 9.1 s all three records cover: 51%)
    fast = [(100 + i + 0.5, 100 + i + 1.0) for i in range(10)]
    slow = [(100 + i + 0.9, 100 + i + 1.0) for i in range(10)]
    rings = {0: ring(0, fast), 1: ring(1, slow), 2: ring(2, fast)}
    cause = slow_cause(rings, 1, now=110.0, window=20.0)
    assert cause == "its peers wait for it 51% of their step in all_reduce at train.py:52"
    assert slow_cause(rings, 0, now=110.0, window=20.0) == ""  # rank 0 waits: not the cause
    p = Progress(step=10, ranks={1: RankProgress(1, 10, slow_ratio=0.45, slow_cause=cause)})
    assert "slow: rank 1 (0.45x; its peers wait for it 51% of their step in all_reduce" in (
        summary_line(p)
    )


def test_the_mlflow_hint_fits_100_columns():
    for uri in ("sqlite:////home/me/project/mlflow.db", "file:///home/me/project/mlruns"):
        text = run_link(uri, "0", "a" * 32)
        lines = text.splitlines()
        assert len(lines) <= 2 and all(len(line) <= 100 for line in lines), lines
        assert f"mlflow ui --backend-store-uri {uri}" in text


def _record(tmp, name, uid=None, **rec):
    d = tmp / f"gangrun-{name}-x"
    d.mkdir(mode=0o700)
    base = {"run_id": name, "caller_pid": os.getpid(), "caller": None, "state": "running"}
    (d / RECORD).write_text(json.dumps({**base, **rec}))
    if uid is not None:
        os.chown(d, uid, uid)
    return d


def test_find_calls_sees_only_this_users_records_and_resolve(tmp_path):
    from gangrun.host.system import process_identity

    me = process_identity(os.getpid())
    _record(tmp_path, "abc123", caller=me, mlflow_run_id="f" * 32, started=1)
    _record(tmp_path, "abd456", caller=me, started=2)
    _record(tmp_path, "zzz999", uid=65534, caller=me)  # another user's: invisible
    _record(tmp_path, "dead00", caller="1:1", started=3)  # its caller is gone
    calls = find_calls(str(tmp_path))
    assert [c.run_id for c in calls][:2] == ["abc123", "abd456"]
    assert "zzz999" not in [c.run_id for c in calls]
    dead = next(c for c in calls if c.run_id == "dead00")
    assert not dead.running and dead.state == "caller gone"
    assert resolve("abc123", calls).run_id == "abc123"
    assert resolve("abd4", calls).run_id == "abd456"
    assert resolve("f" * 32, calls).run_id == "abc123"  # the MLflow run id
    assert resolve("ffff", calls).run_id == "abc123"
    with pytest.raises(Unknown, match="no call of yours"):
        resolve("zzz999", calls)
    assert isinstance(calls[0], CallRef)


def test_a_blank_short_or_ambiguous_run_id_is_a_usage_error(tmp_path, monkeypatch, capsys):
    """An empty id matches nothing (a call without an MLflow run has an empty run id); a
    prefix is 4+ characters and unique, or exit 2 lists the matches."""
    from gangrun.cli import entry as cli
    from gangrun.cli.node import Usage
    from gangrun.host.system import process_identity

    me = process_identity(os.getpid())
    _record(tmp_path, "abcd12", caller=me, function="train", mlflow_run_id="", started=1)
    _record(tmp_path, "abcd34", caller=me, function="evaluate", started=2)
    calls = find_calls(str(tmp_path))
    for bad, says in [
        ("", "empty run id"),
        ("   ", "empty run id"),
        ("abc", "at least 4 characters"),
        ("abcd", "matches 2 calls: abcd12 (train, running), abcd34 (evaluate, running)"),
    ]:
        with pytest.raises(Usage, match=re.escape(says)):
            resolve(bad, calls)
    assert resolve(" abcd3 ", calls).run_id == "abcd34"
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the CLI looks for calls
    for argv, says in [
        (["stop", ""], "gangrun ps lists the run ids"),
        (["logs", " "], "gangrun ps lists the run ids"),
        (["stop", "ab"], "at least 4 characters"),
        (["stacks", "abcd"], "matches 2 calls"),
    ]:
        assert cli.main(argv) == 2, argv
        assert says in capsys.readouterr().err
    assert cli.main(["logs", "abcd12"]) == 0  # (no log files: nothing printed)
    assert cli.main(["logs", "9999"]) == 1  # no such call: not a usage error


def test_a_function_name_names_its_one_running_call(tmp_path, monkeypatch, capsys):
    """``gangrun logs train`` (the FUNCTION column of ``gangrun ps``) names
    the one running call of ``train``; several: exit 2 listing them; ``ps --function``."""
    from gangrun.cli import entry as cli
    from gangrun.cli.node import Usage, function_names
    from gangrun.host.system import process_identity

    assert function_names("main.<locals>.train") == {"main.<locals>.train", "train"}
    assert function_names("jobs/fit.py") == {"jobs/fit.py", "fit.py", "fit"}
    assert function_names("") == set()
    me = process_identity(os.getpid())
    _record(tmp_path, "aaaa01", caller=me, function="Trainer.fit", started=1)
    _record(tmp_path, "aaaa02", caller=me, function="evaluate", started=2)
    _record(tmp_path, "aaaa03", caller=me, function="evaluate", started=3)
    _record(tmp_path, "aaaa04", caller="1:1", function="fit", started=0)  # caller gone
    _record(tmp_path, "aaaa05", caller=me, function="prep.py", state="succeeded", started=4)
    calls = find_calls(str(tmp_path))
    assert resolve("fit", calls).run_id == "aaaa01"  # the running one before the ended one
    assert resolve("Trainer.fit", calls).run_id == "aaaa01"
    assert resolve("prep", calls).run_id == "aaaa05"  # none running: the one that ended
    with pytest.raises(Usage, match=re.escape("'evaluate' matches 2 calls: aaaa02 (evaluate, ")):
        resolve("evaluate", calls)
    with pytest.raises(Unknown, match="no call of yours"):
        resolve("train", calls)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the CLI looks for calls
    assert cli.main(["stacks", "evaluate"]) == 2
    err = capsys.readouterr().err
    assert "aaaa02 (evaluate, running), aaaa03 (evaluate, running)" in err, err
    assert cli.main(["ps", "--function", "evaluate"]) == 0
    out = capsys.readouterr().out
    assert "aaaa02" in out and "aaaa03" in out and "aaaa01" not in out, out
    assert cli.main(["ps", "--function", "fit", "--json"]) == 0
    assert [r["run_id"] for r in json.loads(capsys.readouterr().out)] == ["aaaa01"]
    assert cli.main(["ps", "--function", "nothing"]) == 0
    assert "no running gangrun calls of function 'nothing'" in capsys.readouterr().out
    assert cli.main(["ps", "--function", " "]) == 2


def test_stacks_and_stop_take_their_timeout_as_a_duration(capsys):
    from gangrun.cli import entry as cli

    for argv in (["stacks", "x", "--timeout", "soon"], ["stop", "x", "--timeout", "-1"]):
        assert cli.main(argv) == 2, argv
        assert "is not a duration" in capsys.readouterr().err
    assert cli.main(["stop", "x", "--timeout", "2h"]) == 2  # over the hour allowed
    assert "at most 3600 seconds" in capsys.readouterr().err
    parsed = cli._parsers()[0].parse_args(["stacks", "abcd", "--timeout", "1m"])
    assert parsed.timeout == 60.0


def test_status_line_is_erased_before_rank_output():
    tty = io.StringIO()
    status = StatusLine(tty)
    out = ClearingStream(tty, status)
    status.draw("gangrun: step 1/10")
    out.write("[rank 0] hello\n")
    status.draw("gangrun: step 2/10")
    status.close()
    text = tty.getvalue()
    assert text.index("step 1/10") < text.index("\r\x1b[K[rank 0] hello")
    assert text.endswith("step 2/10\r\x1b[K")


def test_the_status_line_streams_are_handed_to_the_call_and_sys_streams_stay_untouched():
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    class Handle:
        def progress(self):
            raise RuntimeError("the call ended")  # the status line stops following

    seen: dict = {}

    def submit(out, err):
        seen.update(out=out, err=err, sys_streams=(sys.stdout, sys.stderr))
        return Handle()

    before = sys.stdout, sys.stderr
    out, tty = io.StringIO(), Tty()
    handle, status = start(submit, out, tty)
    assert status is not None and isinstance(handle, Handle)
    assert seen["sys_streams"] == before == (sys.stdout, sys.stderr)  # nothing swapped in
    assert isinstance(seen["out"], ClearingStream) and isinstance(seen["err"], ClearingStream)
    status.draw("gangrun: step 1/10")
    seen["out"].write("[rank 0] hello\n")  # the line is erased on the terminal first
    status.close()
    assert out.getvalue() == "[rank 0] hello\n"
    assert tty.getvalue().startswith("\r\x1b[Kgangrun: step 1/10\r\x1b[K")
    # not a terminal: the call writes to the streams themselves, with no status line
    plain = io.StringIO()
    handle, status = start(submit, out, plain)
    assert status is None and seen["out"] is out and seen["err"] is plain
