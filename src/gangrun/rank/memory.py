"""The rank's memory: a sample about once a second, and the figures of a CUDA out-of-memory
error.

A daemon thread of every rank writes ``memory.<rank>`` (`gangrun.wire.memory`): the resident
memory of the rank's process tree, the memory cgroup it is in now (read each time: a rank may
be moved), that cgroup's limit and ``oom_kill`` counter, and, once the rank uses a GPU, what
PyTorch has allocated and reserved there. A sample costs about a millisecond; the thread
never initializes CUDA itself.

A ``torch.cuda.OutOfMemoryError`` gets its device's figures appended to the message the
caller shows (`cuda_oom_note`).
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from typing import Any

from ..host import memory as host
from ..wire import memory as memory_file
from ..wire.memory import MemorySample, fmt_bytes

INTERVAL_S = 1.0


def _cuda() -> tuple[int | None, int | None, int | None]:
    """(device, allocated, reserved) of the current CUDA device, when this rank uses one."""
    torch: Any = sys.modules.get("torch")  # never imported here: only a rank's own
    try:
        cuda = torch.cuda  # AttributeError: no torch, or torch still being imported
        if not cuda.is_initialized():
            return None, None, None
        # this thread's current device is not the rank's (it is per thread): LOCAL_RANK's is
        # the one `gangrun.device()` made current
        dev = int(os.environ.get("LOCAL_RANK", "0")) % max(1, int(cuda.device_count()))
        return dev, int(cuda.memory_allocated(dev)), int(cuda.memory_reserved(dev))
    except Exception:  # a broken device: the sample goes without it
        return None, None, None


def sample(rank: int, pid: int | None = None, before: MemorySample | None = None) -> MemorySample:
    """Rank ``rank``'s memory now (``pid``: the rank's process, default this one); with the
    sample ``before`` it, how fast its resident memory grew since."""
    pid = os.getpid() if pid is None else pid
    now = time.time()
    rss = host.tree_rss(pid) or 0
    growth = None
    if before is not None and now > before.time:
        growth = (rss - before.rss) / (now - before.time)
    cg = host.memory_cgroup(pid)
    figures = host.cgroup_memory(cg) if cg is not None else None
    limit = figures.limit if figures is not None else None
    dev, allocated, reserved = _cuda()
    return MemorySample(
        rank=rank,
        pid=pid,
        time=now,
        rss=rss,
        limit=limit if limit is not None else host.machine_ram(),
        cgroup=cg.name if cg is not None else None,
        cgroup_version=cg.version if cg is not None else None,
        oom_kills=figures.oom_kills if figures is not None else None,
        cuda_device=dev,
        cuda_allocated=allocated,
        cuda_reserved=reserved,
        growth=growth,
        sampler_tid=threading.get_native_id(),
    )


def _loop(fd: int, rank: int, interval: float) -> None:
    last = None
    while True:
        try:
            last = sample(rank, before=last)
            memory_file.write(fd, last)
        except Exception:  # the run directory is gone (the call is ending): stop sampling
            return
        time.sleep(interval)


def start(run_dir: str, rank: int, interval: float = INTERVAL_S) -> bool:
    """Start the rank's sampler (one daemon thread); False when its file cannot be opened."""
    try:
        fd = memory_file.open_for_writing(run_dir, rank)
    except OSError:
        return False
    # the first sample at once, on the thread: nothing of it on the rank's way to its function
    threading.Thread(
        target=_loop, args=(fd, rank, interval), name="gangrun-memory", daemon=True
    ).start()
    return True


def format_cuda_oom(device: int, allocated: int, reserved: int, total: int | None = None) -> str:
    """``On cuda:0, PyTorch had 10.2 GiB allocated and 11.0 GiB reserved (of 15.8 GiB)...``"""
    of = f" (of {fmt_bytes(total)} on the device)" if total else ""
    return (
        f"On cuda:{device}, PyTorch had {fmt_bytes(allocated)} allocated and "
        f"{fmt_bytes(reserved)} reserved{of} when this rank ran out of GPU memory: lower the "
        "batch size, free tensors no longer needed, or see torch.cuda.memory_summary()."
    )


def cuda_oom_note(exc: BaseException) -> str | None:
    """The figures of the device for a ``torch.cuda.OutOfMemoryError`` (None: another
    exception, or no device to ask)."""
    if type(exc).__name__ != "OutOfMemoryError":
        return None
    torch: Any = sys.modules.get("torch")
    try:
        cuda = torch.cuda
        if not cuda.is_initialized():
            return None
        named = re.search(r"GPU (\d+)", str(exc))  # torch's message names the device
        dev = int(named.group(1)) if named else int(cuda.current_device())
        total = int(cuda.get_device_properties(dev).total_memory)
        return format_cuda_oom(
            dev, int(cuda.memory_allocated(dev)), int(cuda.memory_reserved(dev)), total
        )
    except Exception:
        return None


__all__ = ["INTERVAL_S", "cuda_oom_note", "format_cuda_oom", "sample", "start"]
