"""Ranks forked from the warm fork server behave like fresh interpreters, at fork speed."""

from __future__ import annotations

import os
import signal
import sys
import time

import psutil
import pytest

from conftest import assert_no_survivors, pids_alive, run_processes
from gangrun import DistributedError, DistributedTimeoutError, distributed
from gangrun.launch import forkserver
from gangrun.launch.forkserver import client

FS = {"processes": 2, "start_method": "forkserver", "timeout": 60}


def _wait_dead(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not pids_alive([pid]):
            return True
        time.sleep(0.02)
    return False


def _server_pid() -> int:
    info = forkserver.server_info()
    assert info is not None, "no fork server is running"
    return int(info["pid"])


@distributed(**FS)
def _describe(marker: str) -> dict:
    import random
    import sys

    import torch

    fds = {}
    inheritable = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds[int(fd)] = os.readlink(f"/proc/self/fd/{fd}")
            if os.get_inheritable(int(fd)):
                inheritable.add(int(fd))
        except OSError:
            pass
    return {
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "pgid": os.getpgrp(),
        "sid": os.getsid(0),
        "rank": int(os.environ["RANK"]),
        "marker": os.environ.get("FS_TEST_MARKER"),
        "extra": os.environ.get("FS_TEST_EXTRA"),
        "cwd": os.getcwd(),
        "sys_path": list(sys.path),
        "argv": list(sys.argv),
        "threads": torch.get_num_threads(),
        "omp": os.environ.get("OMP_NUM_THREADS"),
        "random": random.random(),
        "torch_seed": torch.initial_seed(),
        "fds": fds,
        "inheritable": inheritable,
        "run_dir": os.environ["GANGRUN_RUN_DIR"],
        "sigint": repr(signal.getsignal(signal.SIGINT)),
        "sigchld": repr(signal.getsignal(signal.SIGCHLD)),
        "sigterm": repr(signal.getsignal(signal.SIGTERM)),
        "cuda_initialized": torch.cuda.is_initialized(),
        "proc_env_run_id": psutil.Process().environ().get("GANGRUN_RUN_ID"),
        "run_id": os.environ["GANGRUN_RUN_ID"],
        "echo": marker,
    }


def test_forked_ranks_get_the_callers_current_env_cwd_and_path(tmp_path, monkeypatch):
    _describe.distributed("warm-up")  # the server now exists, started from the old state
    server = _server_pid()
    extra_path = str(tmp_path / "extra-path")
    monkeypatch.setenv("FS_TEST_MARKER", "first")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(extra_path)
    out = _describe.options(env={"FS_TEST_EXTRA": "x", "OMP_NUM_THREADS": "1"}).distributed("a")
    assert [o["rank"] for o in out] == [0, 1]
    for o in out:
        assert o["ppid"] == server, "ranks are children of the fork server, not of the caller"
        assert o["pgid"] == o["pid"] == o["sid"], "own session and process group"
        assert o["marker"] == "first" and o["extra"] == "x"
        assert o["cwd"] == str(tmp_path)
        assert extra_path in o["sys_path"]
        assert o["threads"] == 1 and o["omp"] == "1"
        assert o["echo"] == "a"
        assert o["cuda_initialized"] is False
        # /proc/PID/environ shows the rank's environment (run sweep, leak checks, ps)
        assert o["proc_env_run_id"] == o["run_id"]
        # only stdio, gangrun's two liveness pipes and the rank's own records in the run
        # directory (stacks, memory, collectives; close-on-exec, so a subprocess the
        # training starts gets none of them); none of the server's sockets
        pipes = [fd for fd, t in o["fds"].items() if fd > 2 and t.startswith("pipe:")]
        files = {fd: t for fd, t in o["fds"].items() if fd > 2 and not t.startswith("pipe:")}
        assert len(pipes) <= 3, o["fds"]  # two liveness pipes (+ the one listdir may show)
        assert all(t.startswith(o["run_dir"] + "/") for t in files.values()), o["fds"]
        assert len(files) <= 4, o["fds"]
        assert not (o["inheritable"] & set(files)), (o["inheritable"], o["fds"])
        assert not [t for t in o["fds"].values() if t.startswith("socket:")], o["fds"]
        assert "default_int_handler" in o["sigint"]
        assert "SIG_DFL" in o["sigchld"] and "SIG_DFL" in o["sigterm"]
    assert out[0]["random"] != out[1]["random"]
    assert out[0]["torch_seed"] != out[1]["torch_seed"]

    # Change everything again: the same server, the new state.
    monkeypatch.setenv("FS_TEST_MARKER", "second")
    sub = tmp_path / "sub"
    sub.mkdir()
    monkeypatch.chdir(sub)
    out2 = _describe.options(env={"OMP_NUM_THREADS": "2"}).distributed("b")
    assert _server_pid() == server
    for o in out2:
        assert o["marker"] == "second" and o["extra"] is None
        assert o["cwd"] == str(sub)
        assert o["threads"] == 2
    assert {o["random"] for o in out2}.isdisjoint({o["random"] for o in out})


def test_edited_code_is_what_runs(tmp_path, monkeypatch):
    mod = tmp_path / "fs_edit_mod.py"
    mod.write_text("def value():\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("fs_edit_mod", None)
    import fs_edit_mod  # type: ignore[import-not-found]

    fn = distributed(**FS)(fs_edit_mod.value)  # pickled by reference: imported in the rank
    assert fn.distributed() == [1, 1]
    mod.write_text("def value():\n    return 'edited'  # a longer body\n")
    assert fn.distributed() == ["edited", "edited"]
    sys.modules.pop("fs_edit_mod", None)


def _outcome(method: str, kind: str) -> tuple:
    def fail(kind: str):
        import os
        import signal
        import sys
        import time

        if int(os.environ["RANK"]) != 1:
            time.sleep(30)
            return "blocked"
        if kind == "raise":
            raise ValueError("boom from rank 1")
        if kind == "exit":
            sys.exit(3)
        if kind == "segv":
            os.kill(os.getpid(), signal.SIGSEGV)
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        return "ok"

    fn = distributed(processes=2, start_method=method, timeout=30, grace_period=2)(fail)
    t = time.monotonic()
    with pytest.raises(DistributedError) as ei:
        fn.distributed(kind)
    err = ei.value
    cause = type(err.__cause__).__name__ if err.__cause__ is not None else None
    return (err.rank, err.exitcode, err.signal, err.exc_type, cause), time.monotonic() - t


@pytest.mark.parametrize("kind", ["raise", "exit", "segv", "kill"])
def test_failures_are_reported_like_spawn(kind):
    fork, t_fork = _outcome("forkserver", kind)
    spawn, _ = _outcome("spawn", kind)
    assert fork == spawn
    assert fork[0] == 1
    assert t_fork < 10, "the other rank must be stopped at once, not after its sleep"


def test_timeout_like_spawn():
    @distributed(**dict(FS, timeout=1.0, grace_period=1.0))
    def sleeper():
        import time

        time.sleep(60)

    t = time.monotonic()
    with pytest.raises(DistributedTimeoutError):
        sleeper.distributed()
    assert time.monotonic() - t < 8


@distributed(**FS)
def _sleep_and_report(path: str) -> None:
    import subprocess
    import time

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    with open(f"{path}.{os.environ['RANK']}", "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    time.sleep(60)


def _read_pids(path: str, n: int = 2, timeout: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            pids = []
            for r in range(n):
                with open(f"{path}.{r}") as f:
                    pids += [int(x) for x in f.read().split()]
            if len(pids) == 2 * n:
                return pids
        except (OSError, ValueError):
            pass
        time.sleep(0.02)
    raise AssertionError("ranks did not report their pids")


def test_server_restarts_after_being_killed(tmp_path):
    _describe.distributed("warm-up")
    old = _server_pid()
    os.kill(old, signal.SIGKILL)
    assert _wait_dead(old)
    out = _describe.distributed("after")
    new = _server_pid()
    assert new != old
    assert all(o["ppid"] == new for o in out)


@pytest.mark.parametrize("window", ["after_send", "after_receive"])
def test_ctrl_c_inside_a_request_does_not_desync_the_channel(window, monkeypatch):
    """Soak seed 8954393 run 565: Ctrl-C landed just after the reply to a fork request was
    read (between bytecodes), the reply was lost and the next call waited 60 s for it. Here
    the KeyboardInterrupt is raised at the two windows of a real server's request; the next
    requests must get their own replies at once, and a call must start on that server."""
    _describe.distributed("warm-up")
    server = client.registry.current()
    assert server is not None
    real_recv = client.p.recv
    fired = []

    def interrupted_recv(sock, maxfds=0):
        if not fired:
            fired.append(window)
            if window == "after_send":  # the reply is still in the channel: a late one
                raise KeyboardInterrupt
            real_recv(sock, maxfds)  # consumed, then the interrupt: no reply left to wait for
            raise KeyboardInterrupt
        return real_recv(sock, maxfds)

    monkeypatch.setattr(client.p, "recv", interrupted_recv)
    with pytest.raises(KeyboardInterrupt):
        server.server_info()
    t = time.monotonic()
    for _ in range(3):
        info = server.server_info()
        assert info.pid == server.pid
    assert time.monotonic() - t < 5.0, "a request waited for a reply already consumed"
    monkeypatch.undo()
    out = _describe.distributed("after")
    assert all(o["ppid"] == server.pid for o in out), "the call did not use the same server"


def _pipes() -> set[str]:
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("pipe:"):
                out.add(fd)
        except OSError:
            pass
    return out


def test_ctrl_c_between_the_fork_and_the_gang_keeping_its_ranks_leaks_no_pipe(monkeypatch):
    """Soak (CI seed) run 39: Ctrl-C landed after the fork server had forked the ranks and
    before the gang kept their handles; each rank's status pipe stayed open in the caller."""
    import gc

    from gangrun.launch.forkserver.spawner import ForkServerSpawner

    _describe.distributed("warm-up")
    gc.collect()
    before = _pipes()
    real_start = ForkServerSpawner.start

    def interrupted_start(self, spec, ranks):
        real_start(self, spec, ranks)
        raise KeyboardInterrupt

    monkeypatch.setattr(ForkServerSpawner, "start", interrupted_start)
    with pytest.raises(KeyboardInterrupt):
        _describe.distributed("interrupted")
    monkeypatch.undo()
    gc.collect()
    deadline = time.monotonic() + 5
    while _pipes() - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _pipes() - before, "pipes left open by the interrupted call"
    assert [o["echo"] for o in _describe.distributed("after")] == ["after", "after"]


def test_server_death_stops_its_running_ranks(tmp_path):
    handle = _sleep_and_report.submit(str(tmp_path / "pids"))
    pids = _read_pids(str(tmp_path / "pids"))
    assert sorted(p.pid for p in run_processes()) >= sorted(pids[::2])  # environ is the rank's
    os.kill(_server_pid(), signal.SIGKILL)
    t = time.monotonic()
    with pytest.raises(DistributedError):
        handle.result(timeout=20)
    assert time.monotonic() - t < 10
    for pid in pids:
        assert _wait_dead(pid), f"process {pid} survived the fork server's death"


def test_no_cuda_in_the_server():
    _describe.distributed("warm-up")
    info = forkserver.server_info()
    assert info is not None
    assert "torch" in info["preloaded"]
    assert info["cuda_initialized"] is False


def test_falls_back_to_spawn_when_the_server_cannot_start(monkeypatch, capfd):
    forkserver.discard_server()
    monkeypatch.setattr(client, "BOOT", "import sys; sys.exit(3)")
    try:
        out = _describe.distributed("fallback")
        assert [o["rank"] for o in out] == [0, 1]
        assert all(o["ppid"] == os.getpid() for o in out), "spawned by the caller itself"
        assert "fork server is unavailable" in capfd.readouterr().err
    finally:
        monkeypatch.undo()
        client.registry.start_failure = None
        client.registry.failures = 0
        forkserver.discard_server()


def test_spawner_choice(monkeypatch):
    from gangrun.defaults import resolve
    from gangrun.launch import GangSpec, RankSpec
    from gangrun.launch.forkserver.spawner import ForkServerSpawner
    from gangrun.launch.gang import choose_spawner
    from gangrun.launch.spawn import SpawnSpawner

    spec = GangSpec("x", "/tmp", [RankSpec(0, {})], "/tmp", start_method="spawn")
    assert isinstance(choose_spawner(spec), SpawnSpawner)
    spec.start_method = "forkserver"
    chosen = choose_spawner(spec)
    assert isinstance(chosen, ForkServerSpawner)
    chosen.release(0.0)
    # GANGRUN_START_METHOD is read once, as the option's default; the launcher does not read
    # it again, so a spec (an option) of "auto" stays "auto"
    monkeypatch.setenv("GANGRUN_START_METHOD", "spawn")
    spec.start_method = resolve({}).start_method  # what a call's options resolve to
    assert isinstance(choose_spawner(spec), SpawnSpawner)
    spec.start_method = "auto"
    chosen = choose_spawner(spec)
    assert isinstance(chosen, ForkServerSpawner)
    chosen.release(0.0)


def test_a_failed_start_is_retried_after_its_back_off(monkeypatch, capfd):
    """One failed fork-server start does not send every later ``auto`` call of the process
    to fresh interpreters for good. A real boot failure, then a server that
    can start: calls within the back-off spawn (no new attempt), the first call after it
    uses the fork server again."""
    forkserver.discard_server()
    auto = _describe.options(start_method="auto")
    boot = client.BOOT
    monkeypatch.setattr(client, "BOOT", "import sys; sys.exit(3)")
    # the back-off's clock stands still until the test moves it: a spawned call that takes
    # longer than the back-off (a loaded machine) must not end it
    now = time.monotonic()
    monkeypatch.setattr(client.registry, "clock", lambda: now)
    try:
        out = auto.distributed("fails")
        assert all(o["ppid"] == os.getpid() for o in out), "spawned by the caller itself"
        assert "fork server is unavailable" in capfd.readouterr().err
        assert client.registry.start_failure is not None
        monkeypatch.setattr(client, "BOOT", boot)  # the server can start from now on
        wait = client.registry.retry_in()
        assert wait == client.RETRY_FIRST_S
        out = auto.distributed("backing-off")
        assert all(o["ppid"] == os.getpid() for o in out), "retried within the back-off"
        assert forkserver.server_info() is None
        later = time.monotonic() + wait + 1.0  # the back-off is over
        monkeypatch.setattr(client.registry, "clock", lambda: later)
        out = auto.distributed("retried")
        server = _server_pid()
        assert all(o["ppid"] == server for o in out), "not forked from the restarted server"
        assert (client.registry.start_failure, client.registry.failures) == (None, 0)
        assert "fork server is unavailable" not in capfd.readouterr().err
    finally:
        monkeypatch.undo()
        client.registry.start_failure = None
        client.registry.failures = 0
        forkserver.discard_server()


CALLER = """
import os, sys, time
from gangrun import distributed
from gangrun.launch import forkserver

@distributed(processes=2, start_method="forkserver", timeout=120)
def work(path, block):
    import subprocess, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    with open(f"{path}.{os.environ['RANK']}", "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    if block:
        time.sleep(60)
    child.kill()
    return os.environ["RANK"]

path, mode = sys.argv[1], sys.argv[2]
if mode == "exit":
    print(work.distributed(path, False), flush=True)
    print("SERVER", forkserver.server_info()["pid"], flush=True)
else:
    h = work.submit(path, True)
    print("SERVER", forkserver.server_info()["pid"], flush=True)
    time.sleep(120)
"""


def test_caller_sigkill_kills_ranks_and_server(script, tmp_path):
    path = str(tmp_path / "pids")
    proc = script(CALLER, path, "kill")
    try:
        line = proc.stdout.readline()
        assert line.startswith("SERVER"), line + proc.stderr.read()
        server = int(line.split()[1])
        pids = _read_pids(path)
        proc.kill()
        proc.wait(10)
        for pid in [server, *pids]:
            assert _wait_dead(pid), f"process {pid} survived the caller's SIGKILL"
        assert_no_survivors(proc.pid)
    finally:
        proc.kill()
        proc.communicate(timeout=10)


def test_server_gone_after_caller_exits(script, tmp_path):
    proc = script(CALLER, str(tmp_path / "pids"), "exit")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    server = int(out.split("SERVER")[1].split()[0])
    assert _wait_dead(server), "the fork server outlived its caller"
    assert_no_survivors(proc.pid)
