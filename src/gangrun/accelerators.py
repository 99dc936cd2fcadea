"""Accelerator detection (NVML, then ``nvidia-smi``, then torch), all lazy.

Nothing here initialises CUDA in the caller unless both NVML and ``nvidia-smi`` are
unavailable and a GPU device node exists, in which case torch is asked as a last resort.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Accelerator:
    index: int  # physical index (what CUDA_VISIBLE_DEVICES takes)
    name: str  # e.g. "NVIDIA H100 80GB HBM3"
    uuid: str = ""


def _nvml_query() -> list[Accelerator] | None:
    try:
        import pynvml  # type: ignore[import-not-found]
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

    Keeps training code identical between a laptop (``processes=2``) and a GPU node.
    """
    import torch

    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        return torch.device("cuda", local % max(1, torch.cuda.device_count()))
    return torch.device("cpu")


def backend() -> str:
    """The process-group backend matching :func:`device`: ``"nccl"`` with CUDA, else ``"gloo"``."""
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


__all__ = ["Accelerator", "detect", "matches_type", "device", "backend"]
