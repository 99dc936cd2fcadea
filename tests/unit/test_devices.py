"""Choosing GPUs: gpus=[i, j], exact reservations, and what `gangrun info` shows of each GPU.

The device lists and NVML answers are fakes (hardware we lack); the reservations are real
file locks in a private directory.
"""

from __future__ import annotations

import os
import types

import pytest

from gangrun import LaunchError, distributed
from gangrun.host import accelerators, reservation
from gangrun.host.accelerators import Accelerator, GpuProcess, GpuUsage
from gangrun.lifecycle.plan import base_env, plan_local

DEVS = [Accelerator(i, "NVIDIA H100 80GB HBM3", f"GPU-{i}abc") for i in (0, 1, 2, 3)]


@pytest.fixture(autouse=True)
def private_lock_dir(tmp_path, monkeypatch):
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))


def _noop() -> None:
    pass


def test_select_devices_by_index():
    assert [d.index for d in accelerators.select_devices(DEVS, [3, 0])] == [3, 0]
    assert accelerators.select_devices(DEVS, 2) == DEVS  # a count: the reservation picks


def test_select_devices_absent_names_the_visible_ones():
    visible = [DEVS[1], DEVS[2]]  # e.g. CUDA_VISIBLE_DEVICES=1,2
    with pytest.raises(LaunchError) as info:
        accelerators.select_devices(visible, [0, 2, 5])
    msg = str(info.value)
    assert "GPU 0, 5 are not visible" in msg
    assert "1 (NVIDIA H100 80GB HBM3), 2 (NVIDIA H100 80GB HBM3)" in msg
    with pytest.raises(LaunchError, match=r"gpus=3 but this node has 2 visible GPU"):
        accelerators.select_devices(visible, 3)


@pytest.mark.parametrize(
    "gpus, fragment",
    [
        ([], "names no GPU"),
        ([0, 0], "names a device twice"),
        ([0, -1], "integers >= 0"),
        ([0, 1.5], "integers >= 0"),
        ([True], "integers >= 0"),
    ],
)
def test_bad_device_lists(gpus, fragment):
    with pytest.raises(LaunchError, match=fragment):
        distributed(gpus=gpus)(_noop)


def test_reserve_exact_busy_names_the_holder():
    held = reservation.reserve_exact([DEVS[3]])
    try:
        with pytest.raises(LaunchError) as info:
            reservation.reserve_exact([DEVS[0], DEVS[3]])
        msg = str(info.value)
        assert f"GPU 3 (caller pid {os.getpid()})" in msg and "gpus=[0, 3]" in msg
        # the free one was not kept
        reservation.reserve_exact([DEVS[0]]).release()
    finally:
        held.release()
    got = reservation.reserve_exact([DEVS[0], DEVS[3]])
    assert got.indices == [0, 3]
    got.release()


def test_plan_resolves_a_device_list(monkeypatch):
    monkeypatch.setattr(accelerators, "detect", lambda: list(DEVS))
    opts = distributed(gpus=[2, 0])(_noop).settings
    plan = plan_local(_noop, opts)
    assert plan.world_size == 2 and plan.gpus_wanted == [2, 0]
    assert [d.index for d in plan.devices] == [2, 0]
    got = reservation.reserve_exact(plan.devices)  # what the supervisor acquires
    try:
        assert base_env(opts, 2, got.devices)["CUDA_VISIBLE_DEVICES"] == "2,0"
    finally:
        got.release()
    bad = distributed(gpus=[7])(_noop).settings
    with pytest.raises(LaunchError, match="GPU 7 is not visible"):
        plan_local(_noop, bad)


def test_format_gpu_report():
    usage = {
        0: GpuUsage(0, 80 << 30, 79 << 30, []),
        1: GpuUsage(
            1,
            80 << 30,
            20 << 30,
            [GpuProcess(4242, 60 << 30, "alice", "python"), GpuProcess(77, None, None, None)],
        ),
    }
    lines = accelerators.format_gpu_report(DEVS[:3], usage, me="bob")
    assert (
        lines[0] == "  0: NVIDIA H100 80GB HBM3 (GPU-0abc), 79.0 GiB free of 80.0 GiB, no processes"
    )
    assert lines[1] == "  1: NVIDIA H100 80GB HBM3 (GPU-1abc), 20.0 GiB free of 80.0 GiB"
    assert lines[2] == "       pid 4242 python, alice, 60.0 GiB"
    assert lines[3] == "       pid 77, unknown user, ?"
    assert lines[4] == "  2: NVIDIA H100 80GB HBM3 (GPU-2abc)"  # NVML said nothing of it
    assert accelerators.format_gpu_report(DEVS[:1], None) == [
        "  0: NVIDIA H100 80GB HBM3 (GPU-0abc)"
    ]
    mine = accelerators.format_gpu_report(DEVS[1:2], usage, me="alice")
    assert mine[1].endswith("alice (you), 60.0 GiB")


def _fake_nvml(procs_by_gpu):
    """A stand-in for the pynvml module answering for len(procs_by_gpu) GPUs."""
    calls = []

    def running(h):
        if procs_by_gpu[h] is None:
            raise RuntimeError("not supported")
        return [types.SimpleNamespace(pid=p, usedGpuMemory=m) for p, m in procs_by_gpu[h]]

    return types.SimpleNamespace(
        nvmlInit=lambda: calls.append("init"),
        nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlDeviceGetCount=lambda: len(procs_by_gpu),
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(
            total=80 << 30, free=(10 + h) << 30
        ),
        nvmlDeviceGetComputeRunningProcesses=running,
        calls=calls,
    )


def test_gpu_usage_from_nvml():
    nvml = _fake_nvml([[(os.getpid(), 1 << 30)], None])
    usage = accelerators.gpu_usage(nvml)
    assert usage is not None and set(usage) == {0, 1}
    assert usage[0].free_bytes == 10 << 30
    (me,) = usage[0].processes
    assert me.pid == os.getpid() and me.used_bytes == 1 << 30 and me.user  # our own process
    assert usage[1].processes == []  # the query is not supported there: no list
    assert nvml.calls == ["init", "shutdown"]


def test_gpu_usage_without_a_driver():
    def fail():
        raise RuntimeError("NVML Shared Library Not Found")

    assert accelerators.gpu_usage(types.SimpleNamespace(nvmlInit=fail)) is None


@pytest.mark.parametrize(("local_rank", "count", "want"), [("0", 2, 0), ("3", 4, 3), ("5", 4, 1)])
def test_device_makes_the_ranks_gpu_current(monkeypatch, local_rank, count, want):
    """`gangrun.device()` sets the rank's current CUDA device (nccl needs it). No GPU
    here: CUDA's answers are stand-ins, the call to `set_device` is recorded."""
    torch = pytest.importorskip("torch")
    import gangrun

    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    dev = gangrun.device()
    assert dev == torch.device("cuda", want)
    assert [torch.device(d).index for d in chosen] == [want]
    assert gangrun.backend() == "nccl"


def test_device_on_cpu_sets_no_cuda_device(monkeypatch):
    torch = pytest.importorskip("torch")
    import gangrun

    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    assert gangrun.device() == torch.device("cpu") and chosen == []


def test_accelerators_lists_the_visible_gpus(tmp_path, monkeypatch):
    # A fake nvidia-smi (hardware we lack) on PATH, no NVML: what a script choosing between GPU
    # and CPU ranks sees, CUDA_VISIBLE_DEVICES honoured.
    import gangrun

    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho '0, NVIDIA H100, GPU-aaa'\necho '1, NVIDIA H100, GPU-bbb'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(accelerators, "_nvml_query", lambda: None)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert [(d.index, d.uuid) for d in gangrun.accelerators()] == [(0, "GPU-aaa"), (1, "GPU-bbb")]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert gangrun.accelerators() == [Accelerator(1, "NVIDIA H100", "GPU-bbb")]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert gangrun.accelerators() == []
