"""Watching a running call, with real ranks: stacks on demand, progress and slow
ranks from the step reports, the final values on the MLflow run, the DEBUG narration, and
``gangrun ps / logs / stacks / stop`` from another process against a call made by a script
(``gangrun run``) -- including another user's attempt, which is refused."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import subprocess
import sys
import textwrap
import time

import mlflow
import pytest
import watchfns

import gangrun
from conftest import assert_no_survivors, run_bounded, run_python

pytestmark = pytest.mark.slow


def test_stacks_of_a_running_call_which_then_finishes_normally(tmp_path):
    flag = tmp_path / "stop"
    fn = gangrun.distributed(processes=2, timeout=120)(watchfns.spin_until)
    h = fn.submit(str(flag))
    deadline = time.monotonic() + 60
    while h.progress().ranks.keys() != {0, 1}:  # both ranks are in their loop
        assert time.monotonic() < deadline and not h.done()
        time.sleep(0.1)
    stacks = h.stacks()
    assert set(stacks) == {0, 1}
    for text in stacks.values():
        assert "spin_until" in text and "watchfns.py" in text, text
        assert text.count("Thread 0x") + text.count("Current thread") >= 2  # all threads
    again = h.stacks()  # a second request reads only its own dump
    assert set(again) == {0, 1} and all(t.count("spin_until") == 1 for t in again.values())
    assert not h.done()
    flag.write_text("")
    assert h.result(60) == [0, 1]
    assert h.stacks() == {}  # nothing runs any more


@pytest.mark.mlflow
def test_progress_eta_slow_rank_and_final_values_on_mlflow(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("GANGRUN_SLOW_AFTER", "1")  # the 60 s window, shortened
    fn = gangrun.distributed(processes=2, timeout=120)(watchfns.uneven)
    h = fn.submit(100)  # rank 1: 5 s; rank 0: 0.5 s
    seen = None
    deadline = time.monotonic() + 60
    while not h.done() and time.monotonic() < deadline:
        p = h.progress()
        if p.slow:
            seen = p
            break
        time.sleep(0.2)
    assert seen is not None, "rank 1 was never marked slow"
    assert set(seen.slow) == {1} and 0 < seen.slow[1] < 0.8
    assert seen.total == 100 and seen.eta_s is not None and seen.rate
    assert seen.step == seen.ranks[1].step  # the gang's step is its slowest rank's
    assert h.result(60) == [0, 1]
    assert h.progress().step == 100  # after the end: the last values, kept
    run = mlflow.MlflowClient(tracking_uri=uri).get_run(h.mlflow_run_id)
    assert run.data.metrics["gangrun.step"] == 100  # the last report, not a throttled one
    assert run.data.metrics["gangrun.total_steps"] == 100
    assert run.data.metrics["gangrun.steps_per_second"] > 0
    assert run.data.tags.get("gangrun.slow_ranks", "").startswith("1 (")


NARRATE = """
import sys, gangrun, watchfns
ok = gangrun.distributed(processes=2, timeout=60)(watchfns.uneven)
ok.distributed(3)
bad = gangrun.distributed(processes=2, timeout=60)(watchfns.fail_on)
try:
    bad.distributed(1)
except gangrun.DistributedError as e:
    print("FAILED AS EXPECTED", file=sys.stderr)
"""


def test_debug_log_narrates_a_successful_and_a_failed_call(tmp_path):
    path = os.path.dirname(watchfns.__file__) + os.pathsep + os.environ["PYTHONPATH"]
    proc = run_python(
        NARRATE, env={"GANGRUN_LOG_LEVEL": "DEBUG", "PYTHONPATH": path}, cwd=tmp_path, timeout=120
    )
    err = proc.stderr
    assert proc.returncode == 0 and "FAILED AS EXPECTED" in err, err
    calls = re.findall(r"call (\w+): plan: (\w+) on 2 rank", err)
    assert [fn for _, fn in calls] == ["uneven", "fail_on"], err
    good, bad = (rid for rid, _ in calls)
    for rid in (good, bad):
        for line in (
            rf"call {rid}: spawner: ",
            rf"call {rid}: attempt 1/1 launching: run dir /\S+gangrun-{rid}-\S+, logs ",
            rf"call {rid}: 2 rank\(s\) started in [\d.]+s by \w+, rendezvous port \d+",
            rf"call {rid}: rank 0 started: pid \d+",
            rf"call {rid}: rank 1 started: pid \d+",
            rf"call {rid}: teardown: ",
        ):
            assert re.search(line, err), (line, err)
    assert re.search(rf"call {good}: rank 1 exited with code 0 after [\d.]+s", err)
    assert re.search(rf"call {good}: ended succeeded after [\d.]+s\n", err)
    assert re.search(rf"call {bad}: rank 1 exited with code 3 after [\d.]+s\n", err)
    assert re.search(rf"call {bad}: teardown: stopping live rank\(s\) \[0\]", err)
    assert re.search(
        rf"call {bad}: rank 0 exited with SIGTERM after .*stopped by the teardown", err
    )
    assert re.search(rf"call {bad}: ended failed after [\d.]+s: DistributedError: Rank 1", err)


# ------------------------------------------------------------------ the node's calls
SCRIPT = """
import os, sys, time, gangrun
rank = int(os.environ["RANK"])
def train_loop():
    for step in range(1, 100000):
        gangrun.report_step(step, 100000)
        if step % 20 == 1:
            print(f"rank {rank} at step {step}", flush=True)
        time.sleep(0.01)
train_loop()
"""


def cli(*args, timeout=60, **kw):
    return run_bounded([sys.executable, "-m", "gangrun", *args], timeout=timeout, **kw)


def wait_listed(pid, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for rec in json.loads(cli("ps", "--json").stdout):
            if rec["caller_pid"] == pid and rec["state"] == "running" and rec["pids"]:
                return rec
        time.sleep(0.3)
    raise AssertionError(f"no running call of pid {pid} in gangrun ps")


AS_NOBODY = """
import os, socket, sys
import json, logging, tempfile
import gangrun, gangrun.cli.entry as cli, gangrun.cli.node, gangrun.lifecycle.control
import gangrun.host.system, gangrun.progress_view, gangrun.wire.rundir
cli._parsers()  # every module the command needs, loaded while still root (the stdlib is
# under /root, which another user cannot read)
run_id, control = sys.argv[1], sys.argv[2]
os.setgid(65534); os.setuid(65534)  # from here on: another user
try:
    socket.socket(socket.AF_UNIX).connect(control)
    print("CONNECTED")
except PermissionError:
    print("NO ACCESS TO THE SOCKET")
sys.exit(cli.main(["stop", run_id]))
"""


@pytest.mark.mlflow
def test_ps_logs_stacks_stop_against_a_script_call(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    (tmp_path / "train.py").write_text(textwrap.dedent(SCRIPT))
    env = dict(os.environ, MLFLOW_TRACKING_URI=uri)
    run = subprocess.Popen(
        [sys.executable, "-m", "gangrun", "run", "--processes", "2", "train.py"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        rec = wait_listed(run.pid)
        rid, mlflow_id = rec["run_id"], rec["mlflow_run_id"]
        assert rec["caller_kind"] == "gangrun run" and rec["world_size"] == 2
        assert rec["function"].endswith("train.py") and mlflow_id
        table = cli("ps").stdout
        assert re.search(
            rf"^{rid}\s+\S*train.py\s+2\s+-\s+\S+\s+running\s+{mlflow_id}\s+"
            rf"{run.pid} gangrun run$",
            table,
            re.M,
        ), table
        # each rank's memory: resident memory of its tree against its limit
        deadline = time.monotonic() + 30
        while len(rec["memory"]) < 2 and time.monotonic() < deadline:
            time.sleep(0.3)
            rec = wait_listed(run.pid)
            table = cli("ps").stdout
        memory = {r: m for r, m in rec["memory"].items() if m["pid"] == rec["pids"].get(r)}
        assert set(memory) == {"0", "1"}, rec
        assert all(m["rss"] > 1 << 20 and m["limit"] > m["rss"] for m in memory.values())
        assert re.search(r"^  memory: rank 0  [\d.]+ [MG]iB of [\d.]+ [MG]iB \(\d+%\)", table, re.M)
        assert re.search(r"^ {10}rank 1  [\d.]+ [MG]iB of ", table, re.M), table
        # logs: one rank, by a prefix of the run id; then every rank, by the MLflow run id
        deadline = time.monotonic() + 30
        while "rank 1 at step 21" not in cli("logs", rid[:6], "--rank", "1").stdout:
            assert time.monotonic() < deadline
            time.sleep(0.3)
        assert "rank 0 at" not in cli("logs", rid[:6], "--rank", "1").stdout
        both = cli("logs", mlflow_id).stdout
        assert "[rank 0] rank 0 at step 1" in both and "[rank 1] rank 1 at step 1" in both
        follow = subprocess.Popen(
            [sys.executable, "-m", "gangrun", "logs", rid, "--rank", "0", "--follow"],
            stdout=subprocess.PIPE,
            text=True,
        )
        st = cli("stacks", rid)
        assert st.returncode == 0, st.stderr
        assert "--- rank 0 (pid" in st.stdout and "--- rank 1 (pid" in st.stdout
        assert st.stdout.count("in train_loop") == 2, st.stdout
        # another user: sees nothing, cannot reach the socket, and is refused
        nobody = subprocess.run(
            [sys.executable, "-c", AS_NOBODY, rid, os.path.join(rec["run_dir"], "control")],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert nobody.returncode == 1, nobody.stderr
        assert "NO ACCESS TO THE SOCKET" in nobody.stdout
        assert "no call of yours on this node matches" in nobody.stderr
        assert run.poll() is None and wait_listed(run.pid)["run_id"] == rid  # still running
        # stop: the caller's own teardown, the MLflow run KILLED
        stop = cli("stop", rid[:8])
        assert stop.returncode == 0, stop.stderr
        assert f"stopped {rid}" in stop.stdout and "KILLED" in stop.stdout
        out, err = run.communicate(timeout=60)
        assert run.returncode == 130, err
        assert "stopped from the command line (gangrun stop, pid" in err
        followed, _ = follow.communicate(timeout=30)  # --follow ends with the call
        assert follow.returncode == 0 and "rank 0 at step 21" in followed
        status = mlflow.MlflowClient(tracking_uri=uri).get_run(mlflow_id).info.status
        assert status == "KILLED"
        assert "gangrun stop" in mlflow.MlflowClient(tracking_uri=uri).get_run(
            mlflow_id
        ).data.tags.get("gangrun.error", "")
        assert cli("stop", rid).returncode == 1  # nothing left to stop
    finally:
        if run.poll() is None:
            run.kill()
            run.wait(30)
    assert_no_survivors(run.pid)


DEAF_SCRIPT = """
import signal, time, gangrun
signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # replaces gangrun's stack dump: never answers
for step in range(1, 100000):
    gangrun.report_step(step)
    time.sleep(0.05)
"""


def test_a_blank_or_short_run_id_stops_nothing_and_stacks_honours_its_timeout(tmp_path):
    """``gangrun stop ""`` does not stop this call (an ``mlflow=False`` call's MLflow run id
    is empty, and must not match), and ``stacks --timeout 1`` does not wait the caller's own
    5 s for a rank that does not answer."""
    (tmp_path / "deaf.py").write_text(textwrap.dedent(DEAF_SCRIPT))
    run = subprocess.Popen(
        [sys.executable, "-m", "gangrun", "run", "--processes", "2", "--no-mlflow", "deaf.py"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        rec = wait_listed(run.pid)
        rid = rec["run_id"]
        assert not rec["mlflow_run_id"]  # the empty id every untracked call has
        for cmd, blank in [("stop", ""), ("stop", "  "), ("logs", ""), ("stacks", "")]:
            r = cli(cmd, blank)
            assert r.returncode == 2, (cmd, blank, r.stdout, r.stderr)
            assert "empty run id" in r.stderr and "gangrun ps lists the run ids" in r.stderr
        short = cli("stop", rid[:3])
        assert short.returncode == 2 and "at least 4 characters" in short.stderr, short.stderr
        assert cli("stop", "--timeout", "-1", rid).returncode == 2
        assert run.poll() is None and wait_listed(run.pid)["run_id"] == rid  # still running
        t0 = time.monotonic()
        st = cli("stacks", rid, "--timeout", "1")
        took = time.monotonic() - t0
        assert st.returncode == 0, st.stderr
        assert st.stdout.count("(no stack dump: the rank did not answer SIGUSR1)") == 2, st.stdout
        assert took < 4.0, f"stacks --timeout 1 took {took:.1f} s"  # before: 5 s + start-up
        stop = cli("stop", rid[:4])  # 4 characters, unique: enough
        assert stop.returncode == 0 and f"stopped {rid}" in stop.stdout, stop.stderr
        run.communicate(timeout=60)
        assert run.returncode == 130
    finally:
        if run.poll() is None:
            run.kill()
            run.wait(30)
    assert_no_survivors(run.pid)


TICK_SCRIPT = """
import sys, time
for step in range(1, 100000):
    print(f"tick {step}", flush=True)
    time.sleep(0.2)
"""


def test_a_function_name_names_its_one_running_call(tmp_path):
    """``gangrun ps`` shows a FUNCTION column, and a function's name is taken where a run id
    is. Two running calls of ``tick.py`` and one of ``tock.py``: ``tock`` names its call for
    ``logs`` and ``stop``; ``tick`` names two (exit 2, both listed); ``ps --function``."""
    (tmp_path / "tick.py").write_text(textwrap.dedent(TICK_SCRIPT))
    (tmp_path / "tock.py").write_text(textwrap.dedent(TICK_SCRIPT))
    base = [sys.executable, "-m", "gangrun", "run", "--processes", "1", "--no-mlflow"]
    runs = [
        subprocess.Popen(
            [*base, script], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for script in ("tick.py", "tick.py", "tock.py")
    ]
    try:
        ticks = [wait_listed(r.pid)["run_id"] for r in runs[:2]]
        tock = wait_listed(runs[2].pid)["run_id"]
        listed = cli("ps", "--function", "tick")
        assert listed.returncode == 0 and all(t in listed.stdout for t in ticks), listed.stdout
        assert tock not in listed.stdout
        both = cli("logs", "tick")
        assert both.returncode == 2, (both.stdout, both.stderr)
        for t in ticks:
            assert f"{t} (tick.py, running)" in both.stderr, both.stderr
        deadline = time.monotonic() + 30
        while "tick 1" not in (logs := cli("logs", "tock")).stdout:
            assert logs.returncode == 0 and time.monotonic() < deadline, logs.stderr
            time.sleep(0.3)
        stop = cli("stop", "tock.py")
        assert stop.returncode == 0 and f"stopped {tock} (tock.py)" in stop.stdout, stop.stderr
        runs[2].communicate(timeout=60)
        assert runs[2].returncode == 130
        assert all(r.poll() is None for r in runs[:2])  # the other function's calls run on
        for t in ticks:
            assert cli("stop", t).returncode == 0
        for r in runs[:2]:
            r.communicate(timeout=60)
    finally:
        for r in runs:
            if r.poll() is None:
                r.kill()
                r.wait(30)
    for r in runs:
        assert_no_survivors(r.pid)


SLOW_SCRIPT = """
import os, sys, time, gangrun
rank, steps = int(os.environ["RANK"]), int(sys.argv[1])
for step in range(1, steps + 1):
    time.sleep(0.06 if rank == 1 else 0.006)
    gangrun.report_step(step, steps)
"""


def _read_pty(fd: int, proc: subprocess.Popen, timeout: float) -> str:
    chunks = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r, _, _ = select.select([fd], [], [], 0.2)
        if r:
            try:
                data = os.read(fd, 65536)
            except OSError:  # the child side closed
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    return b"".join(chunks).decode("utf-8", "replace")


def test_status_line_on_a_terminal_and_not_in_a_pipe(tmp_path):
    (tmp_path / "slow.py").write_text(textwrap.dedent(SLOW_SCRIPT))
    env = dict(os.environ, GANGRUN_SLOW_AFTER="1", COLUMNS="160")
    cmd = [sys.executable, "-m", "gangrun", "run", "--processes", "2", "--no-mlflow", "slow.py"]
    master, slave = pty.openpty()
    proc = subprocess.Popen([*cmd, "80"], cwd=tmp_path, env=env, stdout=slave, stderr=slave)
    os.close(slave)
    try:
        text = _read_pty(master, proc, 90)
        assert proc.wait(30) == 0
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
    assert "\r\x1b[Kgangrun: step " in text, text[-2000:]
    assert re.search(r"gangrun: step \d+/80 \(\d+%\) · [\d.]+ steps/s · ETA \d+s", text)
    assert re.search(r"slow: rank 1 \(0\.\d\dx\)", text), text[-2000:]
    assert text.rstrip().endswith("\x1b[K") or "\x1b[K" in text[-20:]  # erased at the end
    assert_no_survivors(proc.pid)
    piped = subprocess.run(
        [*cmd, "30"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=90
    )
    assert piped.returncode == 0
    assert "steps/s" not in piped.stderr and "\x1b[K" not in piped.stderr + piped.stdout


PEER = """
import json, os, socket, sys
path = sys.argv[1]
os.setgid(65534); os.setuid(65534)  # another user, with the socket made reachable to it
s = socket.socket(socket.AF_UNIX)
s.connect(path)
try:
    s.sendall(json.dumps({"op": "stop"}).encode() + b"\\n")
except BrokenPipeError:
    pass  # refused before the request was read
print(s.makefile("rb").readline().decode().strip())
"""


def test_control_socket_refuses_a_peer_of_another_uid():
    """Defence in depth: even with the socket reachable (the run directory is 0700 for real),
    a request from another uid (SO_PEERCRED) is refused before it is read: no cancel."""
    import shutil
    import tempfile
    import types

    from gangrun.lifecycle.control import SOCKET, ControlObserver

    tmp_path = tempfile.mkdtemp(prefix="gangrun-peer-test-", dir="/tmp")  # reachable by 65534
    cancelled: list = []
    run = types.SimpleNamespace(
        run_dir=str(tmp_path),
        call=types.SimpleNamespace(run_id="fake"),
        cancel=lambda *a, **k: cancelled.append(a),
    )
    obs = ControlObserver(run)
    obs._serve()
    path = os.path.join(tmp_path, SOCKET)
    os.chmod(tmp_path, 0o755)
    os.chmod(path, 0o666)
    try:
        peer = run_python(PEER, path, check=True)
        reply = json.loads(peer.stdout)
        assert reply["ok"] is False and "another user" in reply["error"]
        assert cancelled == []
    finally:
        obs._close()
        assert obs._thread is not None
        obs._thread.join(10)
        shutil.rmtree(tmp_path, ignore_errors=True)
    assert not obs._thread.is_alive() and not os.path.exists(path)
