"""Process-free tests of the notebook pieces: rendering, checks, source capture, state."""

from __future__ import annotations

import linecache
import pickle
import subprocess
import sys
import traceback
import types

import cloudpickle
import pytest

from gangrun import checks
from gangrun.errors import DistributedError, LaunchError
from gangrun.notebook import html, routing
from gangrun.notebook.state import CallState, RankState
from gangrun.progress_view import Progress
from gangrun.rank import source


# -- checks ------------------------------------------------------------------------------
def _train(epochs: int, batch_size: int = 32) -> None: ...


def test_bind_arguments_names_the_argument_and_suggests():
    checks.bind_arguments(_train, (3,), {"batch_size": 8})
    with pytest.raises(checks.LaunchArgumentError) as ei:
        checks.bind_arguments(_train, (), {"epoch": 3})
    assert isinstance(ei.value, TypeError) and isinstance(ei.value, LaunchError)
    msg = str(ei.value)
    assert "'epoch'" in msg and "Did you mean 'epochs'?" in msg and "Nothing was started" in msg
    with pytest.raises(checks.LaunchArgumentError, match="missing a required argument"):
        checks.bind_arguments(_train, (), {})
    with pytest.raises(checks.LaunchArgumentError, match="too many positional"):
        checks.bind_arguments(_train, (1, 2, 3), {})


def test_bind_arguments_accepts_var_kwargs_and_callables_without_signature():
    checks.bind_arguments(lambda **kw: None, (), {"anything": 1})
    checks.bind_arguments(print, (1, 2), {})  # builtins: no check, no error


def test_unknown_options_lists_valid_and_suggests():
    from gangrun.defaults import check_names

    with pytest.raises(LaunchError) as ei:
        check_names({"num_gpus": 2}, "@distributed argument")
    msg = str(ei.value)
    assert (
        "num_gpus" in msg
        and "did you mean 'gpus'?" in msg
        and "gpu_wait, gpus, grace_period" in msg
    )
    check_names({"gpus": 1}, "option")


def test_refuse_nested_names_rank_and_call():
    checks.refuse_nested({})
    with pytest.raises(LaunchError) as ei:
        checks.refuse_nested({"GANGRUN_RUN_ID": "abc123", "RANK": "1"})
    assert "already inside rank 1 of call abc123" in str(ei.value)
    assert "nested calls are not supported" in str(ei.value)
    assert ei.value.rank == 1


def test_hidden_gpus_message_names_the_variable():
    msg = checks.hidden_gpus_message({"CUDA_VISIBLE_DEVICES": ""}, 0)
    assert msg is not None and "CUDA_VISIBLE_DEVICES=''" in msg
    assert checks.hidden_gpus_message({"CUDA_VISIBLE_DEVICES": "-1"}, 0)
    assert checks.hidden_gpus_message({"CUDA_VISIBLE_DEVICES": "0"}, 0) is None
    assert checks.hidden_gpus_message({}, 0) is None
    assert checks.hidden_gpus_message({"CUDA_VISIBLE_DEVICES": ""}, 2) is None


# -- source --------------------------------------------------------------------------------
CELL = "/tmp/ipykernel_999/42.py"
CELL_SRC = """\
def helper(x):
    return check(x)


def check(x):
    if x > 1:
        raise ValueError("too big: " + str(x))  # shown in the traceback
    return x


def main_fn(x):
    return helper(x)
"""


def _cell_functions():
    linecache.cache[CELL] = (len(CELL_SRC), None, CELL_SRC.splitlines(True), CELL)
    ns: dict = {"__name__": "__main__"}
    exec(compile(CELL_SRC, CELL, "exec"), ns)
    return ns["main_fn"]


def test_source_travels_and_rank_traceback_shows_the_line():
    fn = _cell_functions()
    wrapped = source.with_sources(fn)
    assert isinstance(wrapped, source.WithSources)
    assert wrapped.sources == {CELL: CELL_SRC}
    assert set(wrapped.files.values()) == {CELL}
    assert len(wrapped.files) == 3  # main_fn, helper and check, reached through globals
    data = cloudpickle.dumps((wrapped, (5,), {}))
    del linecache.cache[CELL]  # "the rank": the cell's file is unknown here
    fn2, args, _ = pickle.loads(data)
    assert isinstance(fn2, types.FunctionType) and fn2 is not fn
    assert fn2.__code__.co_filename == CELL
    with pytest.raises(ValueError) as ei:
        fn2(*args)
    tb = "".join(traceback.format_exception(ei.value))
    assert 'raise ValueError("too big: " + str(x))  # shown in the traceback' in tb
    assert "return helper(x)" in tb and "<dynamic-code>" not in tb


def test_importable_functions_travel_without_sources():
    assert source.with_sources(_train) is _train  # by reference: nothing captured
    assert source.with_sources(print) is print


# -- html ------------------------------------------------------------------------------------
def _call(fn_name="train", run_id="r1", world_size=2, max_restarts=0):
    """What the panel reads of the call's record (`CallIdentity`)."""
    return types.SimpleNamespace(
        fn_name=fn_name, run_id=run_id, world_size=world_size, max_restarts=max_restarts
    )


def _state() -> CallState:
    seen: list = []
    st = CallState(_call("train<x>", "run1", max_restarts=1), seen.append)
    st.seen = seen  # type: ignore[attr-defined]
    return st


def test_state_changes_reach_the_callback_and_freeze():
    st = _state()
    st.ended("FAILED")  # before start: nothing to freeze
    assert st.seen == []  # type: ignore[attr-defined]
    st.starting()
    assert st.snapshot.message == "starting 2 ranks…"
    assert st.snapshot.run_id == "run1" and st.snapshot.world_size == 2  # read, not copied
    st.tracking("a" * 32, "sqlite:////x.db", "0")
    st.attempt_started(0)
    st.rank_line(0, "loss <b>1.0</b>\n")
    st.rank_exit(1, -9)
    st.rank_exit(0, -15, stopped=True)
    err = DistributedError("Rank 1 (pid 5) was killed by SIGKILL.\n\nmore", rank=1, exitcode=-9)
    st.ended("FAILED", err)
    st.rank_line(0, "late line")  # after the end: ignored
    snap = st.snapshot
    assert snap.final == "FAILED" and snap.ranks[1].state == "failed"
    assert snap.ranks[0].state == "stopped" and snap.ranks[0].last_line == "loss <b>1.0</b>"
    assert snap.ranks[1].signal == "SIGKILL"
    seen = st.seen  # type: ignore[attr-defined]
    assert seen[0].message == "starting 2 ranks…" and seen[-1].final == "FAILED"
    assert all(s.final is None for s in seen[:-1]) and seen[-1] is snap
    assert snap.ranks[1].state is RankState.FAILED and f"{snap.ranks[1].state}" == "failed"


def test_panel_html_escapes_and_holds_rows_and_chart():
    st = _state()
    st.starting()
    st.tracking("b" * 32, "http://127.0.0.1:5000", "7")
    st.attempt_started(0)
    st.rank_line(0, "<script>alert(1)</script>")
    out = html.render_panel(st.snapshot, {"loss": [(0, 1.0), (1, 0.5)], "acc": [(0, 0.3)]})
    assert "<script>" not in out and "&lt;script&gt;" in out
    assert "train&lt;x&gt;" in out
    assert 'data-rank="0"' in out and 'data-rank="1"' in out
    assert "<svg" in out and "<polyline" in out and "<circle" in out
    assert 'href="http://127.0.0.1:5000/#/experiments/7/runs/' + "b" * 32 in out
    assert "attempt 1/2" in out
    assert html.svg_chart({}) == ""


def _watched(run_dir, world_size):
    """The call's one reader of the step reports (`gangrun.lifecycle.watch.Watch`), as the
    panel reads it."""
    from gangrun.lifecycle.watch import Watch

    run = types.SimpleNamespace(
        call=types.SimpleNamespace(world_size=world_size),
        run_dir=str(run_dir),
        log_dir=str(run_dir),
        gang=None,
        state=None,
    )
    return Watch(run)  # type: ignore[arg-type]


def test_panel_shows_the_attempt_and_the_resumed_step(tmp_path):
    import os
    import time

    st = CallState(_call(max_restarts=3))
    st.starting()
    st.attempt_started(1)
    watch = _watched(tmp_path, 2)
    out = html.render_panel(st.snapshot, progress=watch.progress(fresh=True))
    assert "attempt 2/4" in out and "resumed from" not in out  # nothing reported yet
    now = time.time()  # what progress.report_resumed(1200) leaves in progress.<rank>
    for r in (0, 1):
        line = f"1200 -1 1200 1200 {now:.6f} {now:.6f}".ljust(95) + "\n"
        with open(os.path.join(tmp_path, f"progress.{r}"), "w") as f:
            f.write(line)
    p = watch.progress(fresh=True)
    assert p.resumed_from == 1200
    assert "attempt 2/4, resumed from step 1200" in html.render_panel(st.snapshot, progress=p)
    solo = CallState(_call(run_id="r2", world_size=1))
    solo.starting()
    solo.attempt_started(0)
    resumed = Progress(step=7, resumed_from=7)
    assert " · resumed from step 7" in html.render_panel(solo.snapshot, progress=resumed)
    assert "attempt" not in html.render_panel(solo.snapshot, progress=resumed)


def test_the_panel_reads_the_step_reports_on_one_thread_only():
    # the resumed step comes from the call's Watch, which the panel's own thread reads: a
    # call watched in a kernel starts one polling thread (the panel's), not one per number
    import ast
    from pathlib import Path

    import gangrun.notebook

    made = []
    for path in sorted(Path(gangrun.notebook.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "threading.Thread":
                made.append(path.name)
    # panel.py: the redraws; warm.py: the fork server's prewarm (not per call)
    assert sorted(made) == ["panel.py", "warm.py"]


def test_error_html_root_cause_first_others_folded():
    err = DistributedError("Rank 1 failed: ValueError: <bad>\n\ntrace", rank=1, exitcode=1)
    f = types.SimpleNamespace(
        rank=0, exitcode=1, signal=None, exc_type="RuntimeError", message="x", traceback="tb0"
    )
    err.failures = {1: object(), 0: f}  # type: ignore[attr-defined]
    out = err._repr_html_()
    assert out.index("Rank 1 failed") < out.index("<details>")
    assert "&lt;bad&gt;" in out and "rank 0: RuntimeError: x" in out and "tb0" in out
    assert "<details>" not in DistributedError("plain")._repr_html_()


def test_errors_is_a_leaf_the_notebook_registers_the_html():
    # errors.py imports nothing above it: until the notebook side is loaded (every decoration
    # loads it) an error has no HTML form; then it renders with notebook.html.
    code = (
        "import sys, gangrun\n"
        "from gangrun.errors import DistributedError\n"
        "assert 'gangrun.notebook' not in sys.modules\n"
        "assert DistributedError('x')._repr_html_() is None\n"
        "gangrun.distributed(processes=1)(print)\n"
        "out = DistributedError('x <y>')._repr_html_()\n"
        "assert 'gangrun-error' in out and 'x &lt;y&gt;' in out, out\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_handle_html():
    h = types.SimpleNamespace(
        done=lambda: True,
        fn_name="f<1>",
        world_size=2,
        run_id="r1",
        mlflow_run_id="m1",
        log_dir="/tmp/x",
    )
    out = html.handle_html(h)
    assert "f&lt;1&gt;" in out and "done" in out and "m1" in out and "/tmp/x" in out


# -- routing -------------------------------------------------------------------------------
class FakeOutStream:
    """The two methods of ipykernel's OutStream that routing relies on."""

    def __init__(self):
        import contextvars

        self.var: contextvars.ContextVar = contextvars.ContextVar("p")
        self.var.set({"msg_id": "current"})
        self.writes: list = []

    @property
    def parent_header(self):
        return self.var.get()

    def set_thread_parent(self, parent):
        return self.var.set(parent)

    def reset_thread_parent(self, token):
        self.var.reset(token)

    def write(self, s):
        self.writes.append((self.parent_header["msg_id"], s))

    def flush(self):
        pass


def test_cell_writer_routes_to_the_parent_captured_at_submit():
    import io
    import threading

    s = FakeOutStream()
    tok = s.set_thread_parent({"msg_id": "launch"})
    w = routing.cell_writer(s)
    s.reset_thread_parent(tok)
    t = threading.Thread(target=lambda: w.write("line\n"))
    t.start()
    t.join(5)
    s.write("other\n")
    assert s.writes == [("launch", "line\n"), ("current", "other\n")]
    plain = io.StringIO()
    assert routing.cell_writer(plain) is plain


def test_panel_says_a_resume_onto_another_number_of_ranks(tmp_path):
    # the rank's own report (progress.report_resumed with the saved world)
    # reaches the panel line: "resumed from step 12 saved by 2 ranks onto 3"
    import subprocess

    code = (
        "import sys; from gangrun.rank import progress\n"
        "progress.bind(sys.argv[1], int(sys.argv[2]))\n"
        "progress.report_resumed(12, saved_world=2)\n"
    )
    for r in range(3):
        subprocess.run([sys.executable, "-c", code, str(tmp_path), str(r)], check=True, timeout=60)
    st = CallState(_call(world_size=3))
    st.starting()
    st.attempt_started(0)
    p = _watched(tmp_path, 3).progress(fresh=True)
    assert (p.resumed_from, p.resumed_world) == (12, 2)
    assert "resumed from step 12 saved by 2 ranks onto 3" in html.render_panel(
        st.snapshot, progress=p
    )
