"""Caller side of memory snapshots (docs/long_runs.md, "Memory snapshots"): the call's keeper.

A call with checkpoints (``checkpoint_dir``), ``max_restarts`` and the ``memory`` option on
(the default), on this node's backend, starts a keeper (`gangrun.host.keeper`) before its
first rank and stops it in its one teardown: the snapshot directory in ``/dev/shm`` lives
exactly as long as the call, and a caller killed outright takes it along (the keeper's
lease). `start` also sets the memory cap: a quarter of the memory available now, and at most
nine tenths of what ``/dev/shm`` has free.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import IO, TYPE_CHECKING

from ..host import keeper as keeper_proc
from ..wire import contract

if TYPE_CHECKING:
    from ..host.keeper import Keeper
    from ..options import Options

log = logging.getLogger("gangrun.lifecycle.snapshots")

CAP_FRACTION = 0.25


def mem_available() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo``, in bytes (None when unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def cap_bytes(path: str) -> int:
    """The memory cap of the call's snapshots (every rank's two slots together)."""
    avail = mem_available()
    cap = int(avail * CAP_FRACTION) if avail else 1 << 30
    try:
        st = os.statvfs(path)
        cap = min(cap, int(st.f_bavail * st.f_frsize * 0.9))
    except OSError:
        pass
    return max(0, cap)


def start(
    opts: Options,
    run_id: str,
    ckpt_env: dict[str, str],
    on_ray: bool,
    err: IO[str] | None = None,
) -> tuple[Keeper | None, dict[str, str]]:
    """The call's keeper and the ranks' environment for it; ``(None, {})`` when the call
    takes no memory snapshots (one line on ``err`` when it wanted them and cannot)."""
    if not (opts.memory and ckpt_env and opts.max_restarts > 0):
        return None, {}
    if on_ray:
        log.debug("call %s: no memory snapshots on backend ray", run_id)
        return None, {}
    keeper_proc.sweep()
    try:
        keeper = keeper_proc.start(run_id)
    except OSError as exc:
        print(
            f"gangrun: memory snapshots are off for this call ({exc}); storage checkpoints only.",
            file=err or sys.stderr,
        )
        return None, {}
    env = {
        contract.MEMORY_DIR: keeper.path,
        contract.MEMORY_EVERY: str(opts.memory_every or 0),
        contract.MEMORY_CAP: str(cap_bytes(keeper.path)),
    }
    return keeper, env


def stop(keeper: Keeper | None) -> None:
    """End the keeper: the snapshot directory is removed."""
    if keeper is not None:
        keeper.stop()


__all__ = ["CAP_FRACTION", "cap_bytes", "mem_available", "start", "stop"]
