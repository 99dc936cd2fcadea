"""Rank function of bench_elastic.py (importable by reference inside ranks)."""

from __future__ import annotations

import time
from typing import Any

from table_ranks import _dist


def _make(kind: str, source: str, rank: int | None, world: int | None) -> Any:
    from gangrun.data import TableDataset, VolumeDataset

    if kind == "table":
        return TableDataset(
            source, batch_size=4096, shuffle=True, seed=1, rank=rank, world_size=world
        )
    return VolumeDataset(source, shuffle=True, seed=1, rank=rank, world_size=world)


def _loader(kind: str, ds: Any, workers: int) -> Any:
    if kind == "table":
        return ds.loader(num_workers=workers, persistent_workers=False)
    return ds.loader(batch_size=64, num_workers=workers, persistent_workers=False)


def _samples(kind: str, loader: Any) -> tuple[int, float]:
    """Samples of the pass, and the seconds to its first batch (the pass's setup: workers
    started, and for a rest, the rest computed)."""
    t = time.perf_counter()
    first = 0.0
    n = 0
    for b in loader:
        if not first:
            first = time.perf_counter() - t
        n += b.num_rows if hasattr(b, "num_rows") else len(b["id"]) if kind == "table" else len(b)
    return n, first


def rest_of_epoch(kind: str, source: str, workers: int, saved_world: int, cut: float) -> dict:
    """Seconds (the ranks start together) of two passes on this rank, ``workers`` DataLoader
    workers each: ``fresh``, a whole epoch in today's per-rank order; ``rest``, the rest of the
    same epoch after ``saved_world`` ranks (no workers) read ``cut`` of it and saved their
    positions (every rank's, as `gangrun.Checkpointer` restores them on another world)."""
    dist = _dist()
    out: dict[str, Any] = {}
    # the saved world's positions: each of its ranks reads `cut` of its share (in this process)
    states: dict[str, Any] = {}
    for r in range(saved_world):
        old = _make(kind, source, r, saved_world)
        it = _loader(kind, old, 0)
        total = len(it)
        for i, _ in enumerate(it):
            if i + 1 >= max(1, int(total * cut)):
                break
        states.update(it.state_dict())
    for arm in ("fresh", "rest"):
        ds = _make(kind, source, None, None)
        loader = _loader(kind, ds, workers)
        if arm == "rest":
            loader.load_state_dict(states)
        dist.barrier()
        t = time.perf_counter()
        n, first = _samples(kind, loader)
        out[arm] = time.perf_counter() - t
        out[arm + "_first"] = first
        out[arm + "_samples"] = n
        del loader
    dist.barrier()
    dist.destroy_process_group()
    return out


def held_vs_rank(kind: str, source: str, workers: int, reps: int) -> dict:
    """Seconds of whole epochs on this rank (the ranks start each pass together), ``workers``
    DataLoader workers: ``rank``, today's per-rank order (a table's batch of 4096 rows, 64
    files a batch); ``held``, the global batch held (``global_batch_size`` = the world's
    batches of the same size, default lanes). ``reps`` passes of each, alternated."""
    from gangrun.data import TableDataset, VolumeDataset

    dist = _dist()
    world = dist.get_world_size()
    per = 4096 if kind == "table" else 64

    def make(arm: str) -> Any:
        held = arm != "rank"
        g: dict[str, int] = {"global_batch_size": per * world} if held else {}
        if arm == "held_one_lane":  # a lane per worker: the layout of the per-rank order
            g["lanes"] = world * max(1, workers)
        if kind == "table":
            size = {} if held else {"batch_size": per}
            ds = TableDataset(source, shuffle=True, seed=1, **size, **g)
            return ds, ds.loader(num_workers=workers, persistent_workers=False)
        ds = VolumeDataset(source, shuffle=True, seed=1, **g)
        size = {} if held else {"batch_size": per}
        return ds, ds.loader(num_workers=workers, persistent_workers=False, **size)

    arms = ("rank", "held", "held_one_lane")
    out: dict[str, Any] = {a: [] for a in arms}
    for i in range(reps):
        for arm in arms[i % 3 :] + arms[: i % 3]:
            ds, loader = make(arm)
            ds.set_epoch(i)
            dist.barrier()
            t = time.perf_counter()
            n, _ = _samples(kind, loader)
            out[arm].append(time.perf_counter() - t)
            out[arm + "_samples"] = n
            del loader
    dist.barrier()
    dist.destroy_process_group()
    return out
