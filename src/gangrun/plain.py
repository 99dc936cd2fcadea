"""A plain call of a decorated function (``train(1, 8)``) runs here as a world of one.

The same training code runs on one process and on many: for the call's duration the process
gets the torchrun variables of rank 0 of a world of one (``RANK=0``, ``LOCAL_RANK=0``,
``WORLD_SIZE=1``, ``LOCAL_WORLD_SIZE=1``, ``NODE_RANK=0``, ``GROUP_RANK=0``,
``MASTER_ADDR=127.0.0.1``, ``MASTER_PORT`` a free port), so ``init_process_group`` works with
its default ``env://`` rendezvous. When the call returns (or raises) those variables are
removed again, and a default process group the call initialised and left behind is
destroyed, as the end of a rank's process would end it: a second plain call starts afresh.

Where the process already is part of a distributed job (``RANK`` or ``WORLD_SIZE`` set: under
torchrun, inside a gangrun rank, or set by the user) nothing is changed. A plain call inside
another plain call, or in another thread during one, shares the outer call's world.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

# what a world of one sets, besides MASTER_PORT (a free port per outermost call)
WORLD_OF_ONE = {
    "RANK": "0",
    "LOCAL_RANK": "0",
    "WORLD_SIZE": "1",
    "LOCAL_WORLD_SIZE": "1",
    "NODE_RANK": "0",
    "GROUP_RANK": "0",
    "MASTER_ADDR": "127.0.0.1",
}
_lock = threading.Lock()
_depth = 0  # plain calls running in this process inside the world set up by the first
_set: dict[str, str] = {}  # what the outermost call set (restored when the last one ends)
_group_before = False  # whether a default process group existed before the world was set up


def _group_initialized() -> bool:
    dist = sys.modules.get("torch.distributed")  # never import torch for this
    try:
        return bool(dist is not None and dist.is_available() and dist.is_initialized())
    except Exception:  # a half-imported or broken torch: nothing of ours to clean up
        return False


def _enter() -> bool:
    global _depth, _set, _group_before
    with _lock:
        if _depth:
            _depth += 1
            return True
        if "RANK" in os.environ or "WORLD_SIZE" in os.environ:
            return False  # already a rank of some world: leave it as it is
        from .host.system import free_port

        _set = {k: v for k, v in WORLD_OF_ONE.items() if k not in os.environ}
        if "MASTER_PORT" not in os.environ:
            _set["MASTER_PORT"] = str(free_port())
        os.environ.update(_set)
        _group_before = _group_initialized()
        _depth = 1
        return True


def _exit() -> None:
    global _depth
    with _lock:
        _depth -= 1
        if _depth:
            return
        try:
            if not _group_before and _group_initialized():
                import torch.distributed as dist

                dist.destroy_process_group()
        finally:
            for key, value in _set.items():
                if os.environ.get(key) == value:
                    del os.environ[key]
            _set.clear()


@contextmanager
def world_of_one() -> Iterator[None]:
    """This process as rank 0 of a world of one for the ``with`` block (see the module)."""
    entered = _enter()
    try:
        yield
    finally:
        if entered:
            _exit()


__all__ = ["world_of_one", "WORLD_OF_ONE"]
