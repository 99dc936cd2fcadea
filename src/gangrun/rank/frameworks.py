"""What DDP, FSDP and DeepSpeed need inside a gangrun rank, in one place.

Every rank already has the torchrun environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ...), which is all that
``torch.distributed.init_process_group()``, DDP and FSDP read. DeepSpeed reads a few more
variables that its own launcher sets, picks an accelerator on its own, and on CPU JIT-compiles
C++ ops (gcc + ninja, ~20-40 s each, first time) that a training job rarely needs.
`deepspeed_setup` settles all of that; call it inside the function before
``deepspeed.initialize`` / ``deepspeed.init_distributed``.

Nothing here imports torch or deepspeed at module import time.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

__all__ = ["deepspeed_env", "deepspeed_setup", "seed_everything"]


def deepspeed_env(environ: Any = None) -> dict[str, str]:
    """The DeepSpeed launcher's extra variables, derived from the torchrun ones.

    ``LOCAL_SIZE`` (DeepSpeed's CPU accelerator counts "devices" with it, else by NUMA
    nodes), ``CROSS_RANK`` and ``CROSS_SIZE`` (node rank and node count). Variables that
    are already set are left alone.
    """
    env = os.environ if environ is None else environ
    out: dict[str, str] = {}
    local_ws = env.get("LOCAL_WORLD_SIZE") or env.get("WORLD_SIZE")
    if local_ws and "LOCAL_SIZE" not in env:
        out["LOCAL_SIZE"] = str(local_ws)
    node_rank = env.get("GROUP_RANK") or env.get("NODE_RANK")
    if node_rank is not None and "CROSS_RANK" not in env:
        out["CROSS_RANK"] = str(node_rank)
    nodes = env.get("GROUP_WORLD_SIZE")
    if nodes is None and env.get("WORLD_SIZE") and local_ws:
        nodes = str(max(1, int(env["WORLD_SIZE"]) // max(1, int(local_ws))))
    if nodes is not None and "CROSS_SIZE" not in env:
        out["CROSS_SIZE"] = str(nodes)
    return out


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover
        return False
    return bool(torch.cuda.is_available())


def deepspeed_setup(*, shm_comm: bool = False) -> str:
    """Prepare this rank for DeepSpeed; returns the accelerator name (``"cuda"``/``"cpu"``).

    - sets ``LOCAL_SIZE``/``CROSS_RANK``/``CROSS_SIZE`` from the torchrun variables;
    - sets ``DS_ACCELERATOR`` to ``cuda`` or ``cpu`` (matching [`gangrun.device`][gangrun.host.accelerators.device])
      unless the user chose one, so DeepSpeed neither guesses nor warns;
    - on CPU, unless ``shm_comm=True``, stops DeepSpeed from JIT-compiling its shared-memory
      all-reduce op (``deepspeed_shm_comm``, ~20 s with gcc+ninja on first use, cached in
      ``TORCH_EXTENSIONS_DIR``); collectives then go through gloo, which is what you want
      for CPU development and CI.

    Must run before ``deepspeed.initialize`` (or ``deepspeed.init_distributed``) in the rank.
    ``DS_ACCELERATOR`` only counts if it runs before ``import deepspeed`` (which picks the
    accelerator); when deepspeed was imported first, DeepSpeed's own detection gives the same
    answer on CPU and CUDA nodes, and the rest still applies. Idempotent. Other JIT ops are chosen by the config, not here: on CPU use a torch
    optimizer (``{"type": "Adam", "params": {"torch_adam": true}}`` or pass one to
    ``deepspeed.initialize``) instead of FusedAdam / DeepSpeedCPUAdam (optimizer offload).
    """
    os.environ.update(deepspeed_env())
    accel = os.environ.get("DS_ACCELERATOR")
    if accel is None:
        accel = "cuda" if _cuda_available() else "cpu"
        os.environ["DS_ACCELERATOR"] = accel
    if accel == "cpu" and not shm_comm:
        ds_torch = importlib.import_module("deepspeed.comm.torch")
        ds_torch.build_shm_op = _no_shm_op  # type: ignore[attr-defined]
    return accel


def _no_shm_op() -> None:
    return None


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy (when installed) and torch the same way on every rank."""
    import random

    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:  # pragma: no cover
        pass  # NumPy is optional: nothing of it to seed
    import torch

    torch.manual_seed(seed)
