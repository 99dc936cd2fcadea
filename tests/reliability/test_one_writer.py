"""One writer per checkpoint location, one call per MLflow run.

A second live call given a running call's ``checkpoint_dir`` is refused before any rank
starts, naming the holder; a holder that died is taken over; two ``Checkpointer``s on one
location in one function are an error when the second is made; two processes resuming one
``run_id=`` at the same moment: one resumes, the other gets a ``LaunchError`` (never both,
never a rank failure); ``gangrun ps`` shows the location a call holds. Without a lock, or with
a check-then-set lease on the run, each test fails."""

from __future__ import annotations

import os
import socket
import sys
import textwrap
import time

import pytest
import writer_funcs

import gangrun
from conftest import assert_no_survivors, run_bounded
from gangrun import LaunchError, checkpoint

pytestmark = pytest.mark.slow
HERE = os.path.dirname(os.path.abspath(__file__))


def _wait_for(path, proc=None, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the caller exited {proc.returncode}: {proc.stderr.read()}")
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def _fn(**opts):
    return gangrun.distributed(processes=1, timeout=120, output="none", **opts)


# ---------------------------------------------------------------- one writer per location
def test_a_second_call_on_a_running_calls_checkpoint_dir_is_refused(tmp_path):
    """Refused while the first call runs its second attempt: a restart keeps the location."""
    where, gate = str(tmp_path / "ckpt"), str(tmp_path / "gate")
    fn = _fn(checkpoint_dir=where)(writer_funcs.counts)
    marker = str(tmp_path / "killed")
    first = fn.options(max_restarts=1, restart_backoff=0.1).submit(6, gate, 3, 2, marker)
    try:
        _wait_for(gate + ".reached")
        try:
            second = fn.submit(6)
        except LaunchError as exc:
            msg = str(exc)
        else:  # (64388f4) let it end before failing: it wrote into the first call's location
            second.result(timeout=100)
            pytest.fail("a second call on a running call's checkpoint_dir was accepted")
        assert f"checkpoint_dir={where!r} is in use by a running call" in msg, msg
        assert f"counts (gangrun call {first.run_id}" in msg, msg
        assert f"on host {socket.gethostname()}, pid {os.getpid()} (this process)" in msg, msg
        assert checkpoint.latest(where).endswith("step-000000003")
    finally:
        open(gate, "w").close()
    restored = os.path.join(where, "step-000000002")  # the second attempt's start
    assert first.result(timeout=100) == [{"start": 2, "w": 6.0, "from": restored}]
    assert os.path.exists(marker)
    # only the first call wrote there: its newest checkpoint is its own last step
    assert checkpoint.latest(where).endswith("step-000000006")
    # once it ended the location is free (its lock file gone): the next call resumes there
    assert not os.path.exists(os.path.join(where, ".gangrun-writer"))
    again = fn.distributed(8)
    assert again[0]["start"] == 6 and again[0]["w"] == 8.0


HOLDER = """
import sys
sys.path.insert(0, {here!r})
import gangrun, writer_funcs
fn = gangrun.distributed(processes=1, timeout=120, output="none", checkpoint_dir={where!r})(
    writer_funcs.counts
)
h = fn.submit(6, {gate!r}, 2)
print(h.run_id, flush=True)
h.result(timeout=100)
"""


def test_a_holder_in_another_process_is_shown_named_and_taken_over_once_dead(tmp_path, script):
    """``gangrun ps`` shows the location a call holds; a call of another process is refused
    naming it; once that caller is SIGKILLed (its lock file left behind), the location is
    taken over and the run resumes from the dead call's last checkpoint."""
    where, gate = str(tmp_path / "ckpt"), str(tmp_path / "gate")
    proc = script(HOLDER.format(here=HERE, where=where, gate=gate))
    try:
        _wait_for(gate + ".reached", proc)
        holder_id = proc.stdout.readline().strip()
        ps = run_bounded([sys.executable, "-m", "gangrun", "ps"], timeout=60, check=True)
        lines = ps.stdout.splitlines()
        (row,) = [i for i, line in enumerate(lines) if line.startswith(holder_id)]
        assert lines[row + 1] == f"  checkpoints: {where} (held by this call)", ps.stdout
        fn = _fn(checkpoint_dir=where)(writer_funcs.counts)
        with pytest.raises(LaunchError) as info:
            fn.submit(6)
        msg = str(info.value)
        assert f"counts (gangrun call {holder_id}" in msg and f"pid {proc.pid}," in msg, msg
        assert "(this process)" not in msg
    finally:
        proc.kill()
        proc.communicate(timeout=60)
    assert_no_survivors(proc.pid, wait=15.0)
    from gangrun.checkpoint import writer

    left = writer.holder(where)
    assert left is not None and left["pid"] == proc.pid and left["live"] is False
    out = fn.distributed(6)  # the dead caller's lock is taken over
    step2 = checkpoint.latest(where).rsplit("-", 1)[0] + "-000000002"  # not the path's 6s
    assert out == [{"start": 2, "w": 6.0, "from": step2}]
    assert writer.holder(where) is None


def test_two_checkpointers_on_one_location_in_one_function_is_an_error_when_made(tmp_path):
    where = str(tmp_path / "ckpt")
    with pytest.raises(gangrun.DistributedError) as info:
        _fn()(writer_funcs.two_managers).distributed(where)
    msg = str(info.value)
    assert f"Checkpointer: {where!r} is already used by another Checkpointer" in msg, msg
    assert "writer_funcs.py:" in msg and "close() the first one" in msg, msg
    # one closed, then another on the same location: fine
    assert _fn()(writer_funcs.one_after_another).distributed(where) == [3]


# ---------------------------------------------------------------- one run, one call
RESUMER = """
import os, sys, time
sys.path.insert(0, {here!r})
import gangrun, mlflow, writer_funcs
from gangrun import LaunchError

tag, flags, rounds, run_id = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
mlflow.MlflowClient().search_experiments(max_results=1)  # warm: both start at the same time
fn = gangrun.distributed(processes=1, timeout=120, output="none", run_id=run_id)(
    writer_funcs.location_then_fail
)


def say(name, text):
    with open(name + ".tmp", "w") as f:
        f.write(text)
    os.rename(name + ".tmp", name)


for i in range(rounds):
    deadline = time.monotonic() + 90
    while not os.path.exists(f"{{flags}}/go.{{i}}"):
        assert time.monotonic() < deadline
        time.sleep(0.001)
    try:
        h = fn.submit(f"{{flags}}/end.{{i}}")
    except LaunchError as exc:
        say(f"{{flags}}/{{tag}}.{{i}}", "refused " + str(exc))
        continue
    say(f"{{flags}}/{{tag}}.{{i}}", "started")
    try:
        say(f"{{flags}}/{{tag}}.{{i}}.done", "ok " + repr(h.result(timeout=100)[0]))
    except Exception as exc:
        say(f"{{flags}}/{{tag}}.{{i}}.done", f"failed {{type(exc).__name__}}: {{exc}}"[:3000])
"""

ROUNDS = 6


@pytest.mark.mlflow
def test_two_processes_resuming_one_run_at_once_one_is_refused(tmp_path, script):
    """The race is in the resume itself: both processes wait for the same file and resume
    within a millisecond of each other, ROUNDS times. Each winner's call fails, so the next
    round resumes a FAILED run whose error tags the resume clears. On 64388f4 both processes
    resumed by the second round, every time; the loser's ranks were given no checkpoint
    location at all when its clearing of the error tags failed (already cleared by the
    winner) and its tracking was turned off."""
    where, open_gate = str(tmp_path / "ckpt"), tmp_path / "open"
    open_gate.touch()
    first = _fn(checkpoint_dir=where)(writer_funcs.location_then_fail).submit(str(open_gate))
    with pytest.raises(gangrun.DistributedError, match="stops here"):
        first.result(timeout=100)  # a FAILED run, its error on it: each resume clears that
    run_id = first.mlflow_run_id
    t0 = time.monotonic()
    flags = tmp_path / "flags"
    flags.mkdir()
    code = textwrap.dedent(RESUMER.format(here=HERE))
    path = tmp_path / "resumer.py"
    path.write_text(code)
    import subprocess

    procs = {
        tag: subprocess.Popen(
            [sys.executable, str(path), tag, str(flags), str(ROUNDS), run_id],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for tag in ("a", "b")
    }
    try:
        for i in range(ROUNDS):
            (flags / f"go.{i}").touch()
            said = {}
            for tag, proc in procs.items():
                _wait_for(str(flags / f"{tag}.{i}"), proc)
                said[tag] = (flags / f"{tag}.{i}").read_text()
            started = [t for t, s in said.items() if s == "started"]
            (flags / f"end.{i}").touch()
            for tag in started:
                _wait_for(str(flags / f"{tag}.{i}.done"), procs[tag])
            done = {t: (flags / f"{t}.{i}.done").read_text() for t in started}
            assert len(started) == 1, f"round {i}: {said} {done}"
            (winner,) = started
            loser = "b" if winner == "a" else "a"
            assert f"stops here; location={where!r}" in done[winner], done[winner]
            print(f"round {i}: {time.monotonic() - t0:.1f}s")
            refusal = said[loser]
            assert refusal.startswith("refused "), refusal
            assert f"pid {procs[winner].pid}" in refusal and socket.gethostname() in refusal
        for proc in procs.values():
            out, err = proc.communicate(timeout=60)
            assert proc.returncode == 0, err[-3000:]
    finally:
        for i in range(ROUNDS):
            (flags / f"end.{i}").touch()
            (flags / f"go.{i}").touch()
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
    for proc in procs.values():
        assert_no_survivors(proc.pid)
    from mlflow.tracking import MlflowClient

    run = MlflowClient().get_run(run_id)
    assert run.info.status == "FAILED" and run.data.tags["gangrun.resumes"] == str(ROUNDS)
