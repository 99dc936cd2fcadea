"""The launcher's reliability: a call with another start-up environment next to a running
one, helpers that outlive their rank, native output, oversized environment values, a caller
that forked and then died."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from conftest import pids_alive
from gangrun import LaunchError, distributed

METHODS = ["spawn", "forkserver"]


def _wait_dead(pids, timeout: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    left = pids_alive(pids)
    while left and time.monotonic() < deadline:
        time.sleep(0.02)
        left = pids_alive(pids)
    return left


def _read_int(path: str, timeout: float = 60.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(path) as f:
                return int(f.read())
        except (OSError, ValueError):
            time.sleep(0.02)
    raise AssertionError(f"{path} was never written")


def _sleep_then_hash(path: str, seconds: float) -> int:
    open(f"{path}.{os.environ['RANK']}", "w").close()
    time.sleep(seconds)
    return hash("gangrun") if os.environ.get("PYTHONHASHSEED") == "0" else 0


def test_other_startup_env_does_not_kill_a_running_call(tmp_path):
    """Call B with PYTHONHASHSEED=0 starts while call A runs on the fork server: B must not
    restart A's server (A would die as 'killed by SIGKILL')."""
    opts = dict(processes=2, start_method="forkserver", timeout=120)
    fn = distributed(**opts)(_sleep_then_hash)
    a = fn.submit(str(tmp_path / "a"), 3.0)
    for r in range(2):
        while not os.path.exists(tmp_path / f"a.{r}"):
            time.sleep(0.02)
    b = fn.options(env={"PYTHONHASHSEED": "0"}).distributed(str(tmp_path / "b"), 0.0)
    assert a.result(timeout=60) == [0, 0]
    assert b[0] == b[1] != 0  # B's ranks really run with PYTHONHASHSEED=0


def _start_helper_and(pid_path: str, end: str) -> str:
    import subprocess

    helper = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)"],
        start_new_session=True,
        env={"PATH": os.environ.get("PATH", "")},  # no GANGRUN_* marker for the sweep
    )
    if os.environ["RANK"] == "0":
        with open(pid_path, "w") as f:
            f.write(str(helper.pid))
    if end == "sigkill" and os.environ["RANK"] == "0":
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)
    if end == "raise" and os.environ["RANK"] == "0":
        raise RuntimeError("helper left behind")
    return "done"


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("end", ["return", "raise"])
def test_detached_helper_does_not_outlive_the_call(tmp_path, method, end):
    """A helper in its own session with its own env does not outlive a normal call."""
    fn = distributed(processes=2, start_method=method, timeout=60)(_start_helper_and)
    path = str(tmp_path / "helper")
    if end == "return":
        assert fn.distributed(path, end) == ["done", "done"]
    else:
        with pytest.raises(Exception, match="helper left behind"):
            fn.distributed(path, end)
    helper = _read_int(path)
    assert not _wait_dead([helper], 5.0), "the detached helper outlived the call"


def test_helper_of_a_killed_forkserver_rank_dies_too(tmp_path):
    """Fork server: the server is the subreaper of a SIGKILLed rank's orphans."""
    from gangrun import DistributedError

    fn = distributed(processes=2, start_method="forkserver", timeout=60)(_start_helper_and)
    path = str(tmp_path / "helper")
    with pytest.raises(DistributedError) as info:
        fn.distributed(path, "sigkill")
    assert info.value.rank == 0
    assert not _wait_dead([_read_int(path)], 5.0), "the orphaned helper survived"


def _printf_native(n: int) -> int:
    import ctypes

    libc = ctypes.CDLL(None)
    for i in range(n):
        libc.printf(b"native line %d of rank %s\n", i, os.environ["RANK"].encode())
    libc.printf(b"native tail without newline of rank %s", os.environ["RANK"].encode())
    return n


@pytest.mark.parametrize("method", METHODS)
def test_native_printf_arrives(capfd, monkeypatch, method):
    """C-level printf from a fork-server rank arrives (a full C stdio buffer that os._exit
    never flushed would lose it), whether or not the server started with PYTHONUNBUFFERED."""
    from gangrun.launch import forkserver

    monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)
    forkserver.discard_server()  # a server started without it
    fn = distributed(processes=2, start_method=method, timeout=60)(_printf_native)
    assert fn.distributed(3) == [3, 3]
    out = capfd.readouterr().out
    for r in range(2):
        for i in range(3):
            assert f"native line {i} of rank {r}" in out, out
        assert f"native tail without newline of rank {r}" in out, out


@pytest.mark.parametrize("method", METHODS)
def test_huge_env_value_is_a_launch_error(method, tmp_path):
    """A 1 MiB variable is a LaunchError, not a raw OSError E2BIG with spawn."""
    fn = distributed(processes=2, start_method=method, timeout=60)(os.getpid)
    with pytest.raises(LaunchError) as info:
        fn.options(env={"GANGRUN_TEST_BIG": "x" * (1 << 20)}).distributed()
    msg = str(info.value)
    assert "GANGRUN_TEST_BIG" in msg and "1.0 MiB" in msg and "E2BIG" in msg
    assert fn.options(env={"GANGRUN_TEST_OK": "x" * 100_000}).distributed()  # under the limit


CALLER_FORKS = """
import os, sys, time
from gangrun import distributed

@distributed(processes=2, start_method=sys.argv[2], timeout=300)
def sleeper(path):
    with open(f"{path}.{os.environ['RANK']}", "w") as f:
        f.write(str(os.getpid()))
    time.sleep(300)

h = sleeper.submit(sys.argv[1])
while not all(os.path.exists(f"{sys.argv[1]}.{r}") for r in range(2)):
    time.sleep(0.02)
child = os.fork()
if child == 0:
    time.sleep(300)
    os._exit(0)
print("CHILD", child, flush=True)
time.sleep(300)
"""


@pytest.mark.parametrize("method", METHODS)
def test_ranks_die_with_a_caller_that_forked(script, tmp_path, method):
    """The caller forks, then is SIGKILLed: the forked child must not hold the liveness pipe
    (and the fork-server channel), else the ranks would live on as long as it does."""
    path = str(tmp_path / "pid")
    proc = script(CALLER_FORKS, path, method)
    child = 0
    try:
        line = proc.stdout.readline()
        assert line.startswith("CHILD"), line + proc.stderr.read()
        child = int(line.split()[1])
        ranks = [_read_int(f"{path}.{r}") for r in range(2)]
        proc.kill()
        proc.wait(10)
        assert not _wait_dead(ranks, 10.0), "the ranks outlived their SIGKILLed caller"
        assert pids_alive([child]), "the forked child is still there (it must not matter)"
    finally:
        proc.kill()
        if child:  # it holds the caller's stdout: first
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.communicate(timeout=10)


def _rank() -> int:
    return int(os.environ["RANK"])


def test_ctrl_c_while_waiting_for_the_fork_server_keeps_its_channel_in_sync(monkeypatch):
    """Found by the soak (seed 5188101, run 46): Ctrl-C landed while the caller waited for the
    fork server's answer to a fork request; that answer stayed in the channel and the next
    call took it for its own ("zip() argument 2 is longer than argument 1"), leaking its
    status pipes. The interrupt is injected exactly there: the receive is replaced by one
    that raises KeyboardInterrupt once, as a SIGINT to the main thread would."""
    import threading

    from gangrun.launch.forkserver import protocol

    fn = distributed(processes=3, timeout=60, start_method="forkserver")(_rank)
    assert fn.distributed() == [0, 1, 2]  # the server is warm
    real = protocol.recv
    armed = {"on": True}

    def interrupted_recv(sock, *args, **kwargs):
        if armed["on"] and threading.current_thread() is threading.main_thread():
            armed["on"] = False
            raise KeyboardInterrupt
        return real(sock, *args, **kwargs)

    monkeypatch.setattr(protocol, "recv", interrupted_recv)
    with pytest.raises(KeyboardInterrupt):
        fn.distributed()
    fds = set(os.listdir("/proc/self/fd"))
    assert fn.options(processes=2).distributed() == [0, 1]
    assert fn.distributed() == [0, 1, 2]
    time.sleep(0.2)
    assert set(os.listdir("/proc/self/fd")) - fds == set()
