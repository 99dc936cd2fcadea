"""A rank killed by the kernel's out-of-memory killer, for real: the test makes a memory cgroup
with a 300 MiB limit (cgroup v1's memory controller, or v2's where that is what is mounted
with the memory controller), rank 1 moves itself into it and allocates past the limit, and the
kernel kills it. The error names the out-of-memory killer, the rank, its resident memory and
the limit, and the cgroup; the peer is stopped as for any death, and nothing is left running.
Where no memory cgroup can be made here (not root, a read-only cgroup filesystem) the test
skips and says why."""

from __future__ import annotations

import os
import re
import time
import uuid

import pytest
from rel_funcs import outgrows_its_cgroup, worker_outgrows_its_cgroup

import gangrun
from conftest import assert_no_survivors
from gangrun import DistributedError
from gangrun.host import memory as host

pytestmark = pytest.mark.slow

LIMIT = 300 << 20
_UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def _write(path: str, value: str) -> bool:
    try:
        with open(path, "w") as f:
            f.write(value)
        return True
    except OSError:
        return False


def _parents() -> list[tuple[int, str]]:
    """Where a memory cgroup may go: v1 under this process's own cgroup (a container's
    delegated one), else at the hierarchy's root; v2 at its root when it has the memory
    controller."""
    mounted = host.mounts()
    out: list[tuple[int, str]] = []
    if 1 in mounted:
        own = host.memory_cgroup()
        if own is not None and own.version == 1:
            out.append((1, own.path))
        out.append((1, mounted[1][1]))
    if 2 in mounted:
        root = mounted[2][1]
        try:
            with open(os.path.join(root, "cgroup.subtree_control")) as f:
                if "memory" in f.read().split():
                    out.append((2, root))
        except OSError:
            pass
    return out


def _make(version: int, parent: str, tried: list[str]) -> str | None:
    path = os.path.join(parent, f"gangrun-oom-{uuid.uuid4().hex[:8]}")
    try:
        os.mkdir(path)
    except OSError as exc:
        tried.append(f"v{version} {path}: {exc}")
        return None
    limit_file = "memory.limit_in_bytes" if version == 1 else "memory.max"
    if not _write(os.path.join(path, limit_file), str(LIMIT)):
        tried.append(f"v{version} {path}: its {limit_file} is not writable")
        os.rmdir(path)
        return None
    _write(os.path.join(path, "memory.swappiness"), "0")  # v1: no swap
    _write(os.path.join(path, "memory.memsw.limit_in_bytes"), str(LIMIT))
    _write(os.path.join(path, "memory.swap.max"), "0")  # v2: no swap
    return path


def _remove(path: str, parent: str) -> None:
    deadline = time.monotonic() + 10
    while os.path.isdir(path):
        try:
            with open(os.path.join(path, "cgroup.procs")) as f:
                for pid in f.read().split():  # none once the rank is dead; to be sure
                    _write(os.path.join(parent, "cgroup.procs"), pid)
            os.rmdir(path)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


@pytest.fixture
def memory_cgroup():
    """A fresh memory cgroup limited to `LIMIT`: its directory, name (as /proc/PID/cgroup
    writes it) and version; removed afterwards."""
    tried: list[str] = []
    for version, parent in _parents():
        path = _make(version, parent, tried)
        if path is not None:
            break
    else:
        why = "; ".join(tried) or "neither cgroup v1's memory controller nor v2's is mounted"
        print(f"no memory cgroup can be made here: {why}")
        pytest.skip(f"no memory cgroup can be made here: {why}")
    root, point = host.mounts()[version]
    name = "/" + os.path.relpath(path, point)
    if root != "/":
        name = root.rstrip("/") + name
    try:
        yield host.Cgroup(name, version, path)
    finally:
        _remove(path, parent)


def _bytes(text: str) -> float:
    number, unit = text.split()
    return float(number) * _UNITS[unit]


@pytest.mark.parametrize("kernel_log", ["readable", "closed"])
def test_a_rank_killed_by_the_out_of_memory_killer_is_named_with_its_figures(
    tmp_path, memory_cgroup, kernel_log, monkeypatch
):
    """With the kernel log closed to the caller (``dmesg_restrict``, a container: the only
    stand-in here), the cgroup's oom_kill counter alone makes the verdict certain."""
    if kernel_log == "closed":
        if host.cgroup_memory(memory_cgroup).oom_kills is None:
            pytest.skip("this kernel's memory cgroup has no oom_kill counter (before 4.13)")
        monkeypatch.setattr(host, "read_kernel_log", lambda *args, **kwargs: None)
    path, name = memory_cgroup.path, memory_cgroup.name
    fn = gangrun.distributed(processes=2, timeout=120)(outgrows_its_cgroup)
    ready = tmp_path / "ready"
    t0 = time.monotonic()
    with pytest.raises(DistributedError) as caught:
        fn.distributed(os.path.join(path, "cgroup.procs"), 2.5, str(ready))
    took = time.monotonic() - t0
    err = caught.value
    msg = str(err)
    print(msg.split("\n\n")[0], f"({took:.1f} s)")
    assert ready.exists(), msg  # rank 1 was in the cgroup and allocating
    assert err.rank == 1 and err.signal == "SIGKILL", msg
    head = msg.split("\n\n")[0]
    m = re.search(
        r"^Rank 1 \(pid (\d+)\) was killed by the out-of-memory killer: "
        r"([\d.]+ [KMG]iB) resident of a ([\d.]+ [KMG]iB) limit \(memory cgroup ([^;)]+)"
        r"(?:; ([\d.]+ [KMG]iB) charged to it at the peak)?\)\. Lower the memory",
        head,
    )
    assert m, head
    assert int(m.group(1)) == int(ready.read_text())
    assert _bytes(m.group(3)) == LIMIT, head
    # its resident memory counts the pages it shares with the process it was forked from,
    # which stay charged to that process's cgroup: the cgroup's own peak is then said too
    assert 0.5 * LIMIT <= _bytes(m.group(2)) <= 4 * LIMIT, head
    assert m.group(4) == name, head
    if m.group(5) is not None:
        assert 0.8 * LIMIT <= _bytes(m.group(5)) <= 1.05 * LIMIT, head
    assert "The other rank(s) [0] were stopped." in msg, msg
    assert err.failures[1].signal == "SIGKILL"
    assert host.cgroup_memory(memory_cgroup).oom_kills in (None, 1)
    assert_no_survivors()


def test_a_dataloader_worker_killed_by_the_out_of_memory_killer_is_named(memory_cgroup):
    """The rank raises torch's "DataLoader worker (pid N) is killed by signal: Killed": the
    error adds that the out-of-memory killer killed that worker, with the figures."""
    if host.read_kernel_log(1) is None:
        pytest.skip("the kernel log cannot be read here: only the rank's cgroup would say")
    fn = gangrun.distributed(processes=2, timeout=120)(worker_outgrows_its_cgroup)
    with pytest.raises(DistributedError) as caught:
        fn.distributed(os.path.join(memory_cgroup.path, "cgroup.procs"), 2.5)
    err = caught.value
    msg = str(err)
    head = msg.split("\n\n")[0]
    print(head)
    assert err.rank == 1 and err.exc_type == "RuntimeError", msg
    m = re.search(r"DataLoader worker \(pids?(?:\(s\))? (\d+)\)", head)
    assert m, head
    worker = m.group(1)
    said = re.search(
        rf"\nIts DataLoader worker \(pid {worker}\) was killed by the out-of-memory killer: "
        r"([\d.]+ [KMG]iB) resident of a 300 MiB limit \(memory cgroup ([^;)]+)",
        head,
    )
    assert said, head
    assert said.group(2) == memory_cgroup.name, head
    assert "The other rank(s) [0] were stopped." in msg, msg
    assert_no_survivors()
