"""Concurrent calls from threads of one caller, and per-node GPU reservation."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import pytest
import rel_funcs

import gangrun
from gangrun import LaunchError
from gangrun.host import reservation
from gangrun.host.accelerators import Accelerator


def test_concurrent_submits_run_side_by_side():
    fn = gangrun.distributed(processes=2, timeout=60)(rel_funcs.tagged)
    handles: dict[int, gangrun.RunHandle] = {}

    def go(i: int) -> None:
        handles[i] = fn.submit(f"call{i}", 1.0)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    results = {i: h.result(timeout=60) for i, h in handles.items()}
    assert sorted(results) == [0, 1, 2]
    for i, res in results.items():
        assert [r["tag"] for r in res] == [f"call{i}"] * 2
        assert len({r["port"] for r in res}) == 1 and len({r["run_dir"] for r in res}) == 1
        for rank in range(2):  # each call's output is its own
            log = handles[i].logs(rank)
            assert f"tag=call{i}" in log
            assert all(f"tag=call{j}" not in log for j in range(3) if j != i)
    assert len({res[0]["port"] for res in results.values()}) == 3
    assert len({res[0]["run_dir"] for res in results.values()}) == 3
    # they overlapped in time (side by side, not one after another)
    assert max(r[0]["start"] for r in results.values()) < min(r[0]["end"] for r in results.values())


@pytest.fixture
def fake_gpus(monkeypatch, tmp_path):
    """Four fake H100s (unique UUIDs) and a private lock directory for this test."""
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    tag = uuid.uuid4().hex[:8]
    devs = [Accelerator(i, "NVIDIA H100 80GB HBM3", f"GPU-{tag}-{i}") for i in range(4)]
    monkeypatch.setattr(gangrun.host.accelerators, "detect", lambda: list(devs))
    return devs


def test_concurrent_gpu_calls_never_share_a_gpu(fake_gpus):
    fn = gangrun.distributed(gpus=2, timeout=60)(rel_funcs.visible_devices)
    h1 = fn.submit(1.5)
    h2 = fn.submit(1.5)
    # all four busy: a third call fails clearly at once by default (gpu_wait=0)
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match="Not enough free GPUs") as ei:
        fn.submit(0.0)
    assert time.monotonic() - t0 < 1.0
    assert "gpu_wait" in str(ei.value) and "GPU " in str(ei.value)
    # with gpu_wait it waits for one of them to finish and takes its GPUs
    h3 = fn.options(gpu_wait=30).submit(0.0)
    r1, r2, r3 = h1.result(60), h2.result(60), h3.result(60)
    s1, s2 = set(r1[0].split(",")), set(r2[0].split(","))
    assert r1[0] == r1[1] and r2[0] == r2[1]
    assert len(s1) == 2 and len(s2) == 2 and not s1 & s2 and s1 | s2 == {"0", "1", "2", "3"}
    assert set(r3[0].split(",")) in (s1, s2)
    # everything released when the calls ended
    with reservation.reserve(fake_gpus, 4, wait=0) as res:
        assert res.indices == [0, 1, 2, 3]


def test_gpu_wait_times_out_clearly(fake_gpus):
    with reservation.reserve(fake_gpus, 3, wait=0):
        fn = gangrun.distributed(gpus=2, gpu_wait=0.5)(rel_funcs.visible_devices)
        t0 = time.monotonic()
        with pytest.raises(LaunchError, match="after waiting 0.5s"):
            fn.distributed(0.0)
        assert 0.4 < time.monotonic() - t0 < 3.0
        # one GPU is free: a 1-GPU call gets exactly that one
        assert gangrun.distributed(gpus=1)(rel_funcs.visible_devices).distributed(0.0) == ["3"]


def test_bad_gpu_wait_is_rejected():
    with pytest.raises(LaunchError, match="gpu_wait"):
        gangrun.distributed(processes=1, gpu_wait=-1)


def test_reservation_is_cross_process_and_freed_when_holder_dies(fake_gpus):
    code = textwrap.dedent(
        f"""
        import sys, time
        from gangrun.host import reservation
        from gangrun.host.accelerators import Accelerator
        devs = [Accelerator(i, "H100", {fake_gpus[0].uuid[:-2]!r} + "-" + str(i)) for i in range(4)]
        res = reservation.reserve(devs, 2, wait=0)
        print("held", res.indices, flush=True)
        time.sleep(60)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=dict(os.environ)
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "held [0, 1]"
        with pytest.raises(LaunchError, match="Not enough free GPUs"):
            reservation.reserve(fake_gpus, 3, wait=0)
        with reservation.reserve(fake_gpus, 2, wait=0) as res:
            assert res.indices == [2, 3]
        proc.kill()  # the holder dies without releasing: the kernel drops its locks
        proc.wait(10)
        with reservation.reserve(fake_gpus, 4, wait=5) as res:
            assert res.indices == [0, 1, 2, 3]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_lock_dir_is_private(fake_gpus):
    d = reservation.lock_dir()
    st = os.stat(d)
    assert st.st_uid == os.getuid() and st.st_mode & 0o777 == 0o700
    os.chmod(d, 0o777)
    try:
        with pytest.raises(LaunchError, match="not a private directory"):
            reservation.lock_dir()
    finally:
        os.chmod(d, 0o700)
