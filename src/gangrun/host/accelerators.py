"""Accelerator detection (NVML, then ``nvidia-smi``, then torch), all lazy.

Nothing here initialises CUDA in the caller unless both NVML and ``nvidia-smi`` are
unavailable and a GPU device node exists, in which case torch is asked as a last resort.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Accelerator:
    """One GPU: its physical ``index``, its ``name`` and its ``uuid`` (empty when unknown)."""

    index: int  # physical index (what CUDA_VISIBLE_DEVICES takes)
    name: str  # e.g. "NVIDIA H100 80GB HBM3"
    uuid: str = ""


def _nvml_query() -> list[Accelerator] | None:
    try:
        import pynvml
    except Exception:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:
        return None
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            uuid = pynvml.nvmlDeviceGetUUID(h)
            out.append(
                Accelerator(
                    i,
                    name.decode() if isinstance(name, bytes) else str(name),
                    uuid.decode() if isinstance(uuid, bytes) else str(uuid),
                )
            )
        return out
    except Exception:
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass  # NVML never initialised (no driver): there is nothing to shut down


def _smi_query() -> list[Accelerator] | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        proc = subprocess.run(
            [exe, "--query-gpu=index,name,uuid", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        return None
    out = []
    for line in proc.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 2 and parts[0].isdigit():
            out.append(Accelerator(int(parts[0]), parts[1], parts[2] if len(parts) > 2 else ""))
    return out


def _has_device_nodes() -> bool:
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/kfd")


def _torch_query() -> list[Accelerator] | None:
    if not _has_device_nodes():
        return None
    try:
        import torch
    except Exception:
        return None
    try:
        if not torch.cuda.is_available():
            return []
        # torch already applies CUDA_VISIBLE_DEVICES; report logical indices as physical.
        return [
            Accelerator(i, torch.cuda.get_device_name(i)) for i in range(torch.cuda.device_count())
        ]
    except Exception:
        return None


def _apply_visible(devs: list[Accelerator], visible: str | None) -> list[Accelerator]:
    if visible is None:
        return devs
    visible = visible.strip()
    if visible == "" or visible == "-1":
        return []
    picked = []
    for item in visible.split(","):
        item = item.strip()
        for d in devs:
            if (item.isdigit() and d.index == int(item)) or (d.uuid and d.uuid.startswith(item)):
                picked.append(d)
                break
    return picked


def detect() -> list[Accelerator]:
    """The GPUs this process may use, honouring ``CUDA_VISIBLE_DEVICES``."""
    for query in (_nvml_query, _smi_query):
        devs = query()
        if devs is not None:
            return _apply_visible(devs, os.environ.get("CUDA_VISIBLE_DEVICES"))
    return _torch_query() or []


def accelerators() -> list[Accelerator]:
    """The GPUs this process may use, honouring ``CUDA_VISIBLE_DEVICES``; empty without any.

    What a script asks before choosing its ranks: every GPU of the node, or CPU ranks on a
    machine without one. Asks the driver (NVML, then ``nvidia-smi``): CUDA is initialised in
    the caller only when neither answers and a GPU device node exists.

    >>> fn = train.options(gpus=None) if gangrun.accelerators() else train.options(processes=2)

    Each entry is an `Accelerator`: its physical ``index`` (as ``nvidia-smi`` and
    ``CUDA_VISIBLE_DEVICES`` number it, and as ``gpus=[...]`` takes it), ``name`` and ``uuid``.
    """
    return detect()


def select_devices(devices: Sequence[Accelerator], want: int | Sequence[int]) -> list[Accelerator]:
    """The GPUs a call may use out of the visible ``devices``.

    ``want`` a count: every visible device (the reservation then takes ``want`` free ones);
    more than are visible is an error. ``want`` a list of physical device indices (as
    ``nvidia-smi`` and ``CUDA_VISIBLE_DEVICES`` number them): exactly those, in that order.
    Raises [`gangrun.LaunchError`][gangrun.errors.LaunchError] naming the visible devices when one is absent.
    """
    from ..errors import LaunchError

    visible = ", ".join(f"{d.index} ({d.name})" for d in devices) or "none"
    if isinstance(want, int):
        if want > len(devices):
            names = ", ".join(sorted({d.name for d in devices})) or "none"
            raise LaunchError(
                f"gpus={want} but this node has {len(devices)} visible GPU(s) ({names}). "
                f"Ask for at most gpus={len(devices)}, or run on a bigger node (backend='ray')."
            )
        return list(devices)
    by_index = {d.index: d for d in devices}
    absent = [i for i in want if i not in by_index]
    if absent:
        which = ", ".join(str(i) for i in absent)
        raise LaunchError(
            f"gpus={list(want)!r}: GPU {which} {'is' if len(absent) == 1 else 'are'} not "
            f"visible on this node. Visible GPUs (index, name): {visible}. Pick among those "
            "(CUDA_VISIBLE_DEVICES hides the others), or give a count, e.g. gpus=2."
        )
    return [by_index[i] for i in want]


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    used_bytes: int | None = None
    user: str | None = None  # None: NVML gave the pid but its owner is not visible here
    name: str | None = None


@dataclass(frozen=True)
class GpuUsage:
    """What NVML says about one GPU: memory and the processes using it."""

    index: int
    total_bytes: int
    free_bytes: int
    processes: list[GpuProcess] = field(default_factory=list)


def _owner(pid: int) -> tuple[str | None, str | None]:
    try:
        import psutil

        p = psutil.Process(pid)
        return p.username(), p.name()
    except Exception:  # another pid namespace, or no permission: unknown owner
        return None, None


def gpu_usage(nvml: Any = None) -> dict[int, GpuUsage] | None:
    """Free memory and compute processes of each GPU, by physical index; ``None`` when NVML
    cannot tell (no ``pynvml``, no driver). ``nvml`` replaces the ``pynvml`` module (tests)."""
    if nvml is None:
        try:
            import pynvml as nvml  # type: ignore[no-redef]
        except Exception:  # not installed: nothing to tell
            return None
    try:
        nvml.nvmlInit()
    except Exception:  # no driver
        return None
    try:
        out = {}
        for i in range(nvml.nvmlDeviceGetCount()):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            mem = nvml.nvmlDeviceGetMemoryInfo(h)
            procs = []
            try:
                running = nvml.nvmlDeviceGetComputeRunningProcesses(h)
            except Exception:  # not supported on this GPU/driver: list no processes
                running = []
            for pr in running:
                user, name = _owner(int(pr.pid))
                used = getattr(pr, "usedGpuMemory", None)
                procs.append(
                    GpuProcess(int(pr.pid), used if isinstance(used, int) else None, user, name)
                )
            out[i] = GpuUsage(i, int(mem.total), int(mem.free), procs)
        return out
    except Exception:  # a driver error midway: report nothing rather than half
        return None
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:  # already shut down
            pass


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / (1 << 30):.1f} GiB"


def format_gpu_report(
    devices: Sequence[Accelerator], usage: dict[int, GpuUsage] | None, me: str | None = None
) -> list[str]:
    """Lines for ``gangrun info``: each GPU, its free memory and who else uses it."""
    lines = []
    for d in devices:
        line = f"  {d.index}: {d.name}" + (f" ({d.uuid})" if d.uuid else "")
        u = (usage or {}).get(d.index)
        if u is not None:
            line += f", {_gib(u.free_bytes)} free of {_gib(u.total_bytes)}"
            if not u.processes:
                line += ", no processes"
        lines.append(line)
        for p in u.processes if u is not None else []:
            who = p.user or "unknown user"
            mine = " (you)" if me is not None and p.user == me else ""
            name = f" {p.name}" if p.name else ""
            lines.append(f"       pid {p.pid}{name}, {who}{mine}, {_gib(p.used_bytes)}")
    return lines


def _tokens(s: str) -> list[str]:
    return [t for t in re.split(r"[^0-9a-z]+", s.lower()) if t]


def matches_type(device_name: str, gpu_type: str) -> bool:
    """Case-insensitive match of ``gpu_type`` against a device name, token-wise.

    ``"H100"`` matches ``"NVIDIA H100 80GB HBM3"``, ``"A10"`` matches ``"NVIDIA A10G"`` but
    not ``"NVIDIA A100-SXM4-80GB"``, ``"rtx 4090"`` matches ``"NVIDIA GeForce RTX 4090"``.
    """
    want = _tokens(gpu_type)
    have = _tokens(device_name)
    if not want:
        return False
    for start in range(len(have) - len(want) + 1):
        ok = True
        for w, h in zip(want, have[start : start + len(want)], strict=True):
            rest = h[len(w) :] if h.startswith(w) else None
            if rest is None or (rest and rest[0].isdigit()):
                ok = False
                break
        if ok:
            return True
    return False


def device() -> Any:
    """The torch device this rank should use: ``cuda:LOCAL_RANK`` when CUDA is there, else CPU.

    A CUDA device is also made this rank's current device (``torch.cuda.set_device``, as
    Accelerate's ``device`` does): ``nccl`` needs it, and tensors made with ``"cuda"`` land
    on the rank's own GPU, not GPU 0. Call it before ``init_process_group``. Keeps training
    code identical between a laptop (``processes=2``) and a GPU node.
    """
    import torch

    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        dev = torch.device("cuda", local % max(1, torch.cuda.device_count()))
        torch.cuda.set_device(dev)
        return dev
    return torch.device("cpu")


def backend() -> str:
    """The process-group backend matching [`device`][gangrun.host.accelerators.device]: ``"nccl"`` with CUDA, else ``"gloo"``."""
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


__all__ = [
    "Accelerator",
    "accelerators",
    "detect",
    "matches_type",
    "select_devices",
    "gpu_usage",
    "format_gpu_report",
    "GpuUsage",
    "GpuProcess",
    "device",
    "backend",
]
