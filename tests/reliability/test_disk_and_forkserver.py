"""A full disk under the run directory (a small tmpfs the test mounts) is said as such, not
as "returned a value that cannot be serialized ... Return plain data"; a fork server killed
mid-call is the cause, not a rank ("Rank 1 was killed by SIGKILL (often the out-of-memory
killer ...)", err.rank set)."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import tempfile
import time

import pytest
from outage_funcs import fills_then_raises, quick, reports_pid_and_sleeps, returns_bytes

import gangrun
from conftest import assert_no_survivors
from gangrun import DistributedError, LaunchError
from gangrun.launch import forkserver

pytestmark = pytest.mark.slow


def _wait_for(paths, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(os.path.exists(p) for p in paths):
        assert time.monotonic() < deadline, f"not all of {paths} appeared"
        time.sleep(0.02)


# ---------------------------------------------------------------- a dead fork server
def test_fork_server_killed_mid_call_is_not_blamed_on_a_rank(tmp_path):
    opts = {"processes": 2, "start_method": "forkserver", "timeout": 60}
    fn = gangrun.distributed(**opts)(reports_pid_and_sleeps)
    handle = fn.submit(str(tmp_path))
    _wait_for([tmp_path / "pid.0", tmp_path / "pid.1"])
    info = forkserver.server_info()
    assert info is not None
    server = int(info["pid"])
    os.kill(server, signal.SIGKILL)
    with pytest.raises(DistributedError) as caught:
        handle.result(timeout=30)
    err = caught.value
    msg = str(err)
    assert err.rank is None, msg  # no rank is the cause
    assert err.exitcode is None and err.signal is None, msg
    assert msg.startswith(f"The fork server (pid {server}) died (killed by SIGKILL)"), msg
    assert "The next call starts a new fork server" in msg, msg
    assert "out-of-memory killer" not in msg.split("launcher")[0], msg  # not a rank's OOM
    assert err.failures == {}, err.failures
    assert_no_survivors()
    assert gangrun.distributed(**opts)(quick).distributed(1) == [1, 2]  # a new server
    info = forkserver.server_info()
    assert info is not None and int(info["pid"]) != server


# ---------------------------------------------------------------- a full disk
@pytest.fixture
def small_disk(tmp_path, monkeypatch):
    """A 2 MiB tmpfs, the caller's temp dir (so the run directory is on it). Where mounting
    is impossible (not root, no tmpfs) it is skipped; tests/unit/test_diskspace.py simulates
    the full disk with /dev/full there."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        # simulated without a mount: tests/unit/test_diskspace.py (/dev/full)
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    monkeypatch.setattr(tempfile, "tempdir", str(mnt))
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_result_too_big_for_the_disk_says_so(small_disk):
    fn = gangrun.distributed(processes=2, timeout=60)(returns_bytes)
    with pytest.raises(DistributedError) as caught:
        fn.distributed(8 << 20)
    err = caught.value
    msg = str(err)
    assert "cannot be serialized" not in msg and "Return plain data" not in msg, msg
    assert "could not write its result: the disk of " in msg, msg
    assert "is full (No space left on device)" in msg, msg
    assert str(small_disk) in msg, msg  # names the directory
    assert isinstance(err.__cause__, OSError), repr(err.__cause__)
    assert err.__cause__.errno == errno.ENOSPC
    assert err.rank in (0, 1)


def test_payload_too_big_for_the_disk_is_a_launch_error(small_disk):
    fn = gangrun.distributed(processes=2, timeout=60)(quick)
    with pytest.raises(LaunchError) as caught:
        fn.distributed(b"p" * (4 << 20))
    msg = str(caught.value)
    assert "cannot be serialized" not in msg, msg
    assert "could not write the call's payload: the disk of " in msg, msg
    assert "is full (No space left on device)" in msg, msg
    assert str(small_disk) in msg, msg
    assert isinstance(caught.value.__cause__, OSError)
    assert not os.listdir(small_disk)


def test_no_room_for_the_error_record_still_names_the_full_disk(small_disk):
    fn = gangrun.distributed(processes=2, timeout=60, output="none")(fills_then_raises)
    with pytest.raises(DistributedError) as caught:
        fn.distributed()
    err = caught.value
    msg = str(err)
    assert err.rank == 1, msg
    assert "is full" in msg and str(small_disk) in msg, msg
    assert_no_survivors()
