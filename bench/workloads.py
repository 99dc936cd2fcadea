"""Functions every launcher in the benchmarks runs (importable by reference from ``bench/``).

Each takes plain arguments; launchers that pass a process index first (``mp.spawn``) go through
the ``*_spawn`` wrappers, which set the torchrun environment first.
"""

from __future__ import annotations

import os
import time


def relaunch_fn(*_args):
    """What a notebook relaunches: a function that imports torch and does a little work."""
    import torch

    return float(torch.ones(4).sum())


def _env(rank: int, world: int, port: int) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )


def relaunch_spawn(index: int, *_args):
    relaunch_fn()


def failing(stamp_dir: str, *_args):
    """Rank 1 raises while rank 0 blocks in a gloo all_reduce; rank 1 notes when it raised."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    if dist.get_rank() == 1:
        time.sleep(0.3)  # rank 0 is inside all_reduce by now
        with open(os.path.join(stamp_dir, f"raised.{os.getpid()}"), "w") as f:
            f.write(repr(time.time()))
        raise RuntimeError("rank 1 fails on purpose")
    dist.all_reduce(torch.ones(1))
    time.sleep(60)


def failing_spawn(index: int, stamp_dir: str, port: int, world: int = 2):
    _env(index, world, port)
    failing(stamp_dir)


def big_result(nbytes: int, send: bool = True):
    """A rank that builds ``nbytes`` of float32 tensor and returns it (or nothing)."""
    import torch

    t = torch.ones(nbytes // 4, dtype=torch.float32)
    return t if send else None


def printer(lines: int, every: int = 0):
    """Print ``lines`` numbered lines; ``every`` > 0 adds a small compute step per line
    batch (a training loop that logs)."""
    import sys

    rank = os.environ.get("RANK", "?")
    w = sys.stdout.write
    acc = 0.0
    t = time.perf_counter()
    for i in range(lines):
        w(f"r{rank} line {i}\n")
        if every and i % every == 0:
            acc += sum(j * 0.5 for j in range(200))
    sys.stdout.flush()
    return time.perf_counter() - t
