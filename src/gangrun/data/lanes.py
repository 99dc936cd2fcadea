"""The global batch held on any number of ranks: an epoch cut into canonical lanes.

Pure arithmetic over item positions (files of a `VolumeDataset`, rows of a `TableDataset`);
this module imports neither torch nor pyarrow.

An epoch's order (from the seed and the epoch alone) is cut into ``K`` *lanes*, contiguous
spans of it, ``K`` fixed for the run (``lanes=``). With a global batch of ``G`` items
(``G`` divisible by ``K``), every lane gives ``b = G // K`` items to each global batch:

- lane ``l`` is positions ``[l*L, (l+1)*L)`` of the order, ``L = B*b``; the epoch has
  ``B = n // G`` global batches (``uneven="drop"``: fewer than ``G`` items of the order's end
  are not read) or ``ceil(n / G)`` (``"pad"``: positions past ``n`` wrap to the order's
  beginning, fewer than ``G`` items read twice). Every global batch is full.
- global batch ``k`` is, for each lane ``l``, lane ``l``'s items ``[k*b, (k+1)*b)``;
- rank ``r`` of ``W`` (``W`` divides ``K``) reads lanes ``[r*K/W, (r+1)*K/W)``: its batch
  ``k`` is those lanes' parts of global batch ``k``, in lane order. So global batch ``k`` is
  the same set of items on every world size that divides ``K``, and where the world stopped
  is one number, ``k``: a resume on any such size continues at global batch ``k``.
- DataLoader worker ``w`` of ``nw`` reads a contiguous run of its rank's lanes
  (`worker_lanes`), so a lane (and the row groups or files in it) is read by one worker; each
  worker yields its part of every batch ``k`` (nothing when it has no lane: more workers than
  lanes per rank), and the loader joins ``nw`` consecutive parts (the DataLoader takes them
  round-robin, in worker order) into the rank's batch.
"""

from __future__ import annotations

import math
from typing import NamedTuple


class LaneLayout(NamedTuple):
    """An epoch of ``items`` items in ``lanes`` lanes, ``part`` items of each lane per global
    batch, ``batches`` global batches."""

    items: int
    lanes: int
    part: int
    batches: int

    @property
    def length(self) -> int:
        """Items of one lane (a multiple of ``part``)."""
        return self.batches * self.part

    @property
    def global_batch(self) -> int:
        return self.lanes * self.part


def workable(lanes: int, upto: int = 64) -> list[int]:
    """The world sizes (up to ``upto``) a run of ``lanes`` lanes can continue on."""
    return [w for w in range(1, min(lanes, upto) + 1) if lanes % w == 0]


def check(global_batch: int, lanes: int, world: int, what: str, rank: int = 0) -> None:
    """A ``ValueError`` naming what to change when ``global_batch`` is not ``lanes`` equal
    parts, or ``world`` ranks cannot each take whole lanes."""
    for name, v in (("global_batch_size", global_batch), ("lanes", lanes)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{what}: {name} must be an integer >= 1, got {v!r}")
    if global_batch % lanes:
        raise ValueError(
            f"{what}: global_batch_size={global_batch} does not split into lanes={lanes} equal "
            f"parts; choose lanes dividing it (e.g. {math.gcd(global_batch, lanes)}) or a "
            f"global batch that is a multiple of {lanes}."
        )
    if lanes % world:
        raise ValueError(
            f"{what} on rank {rank}: world size {world} does not divide lanes={lanes}, so the "
            "ranks cannot each read whole lanes and hold the global batch. This run's lanes "
            f"work on {', '.join(map(str, workable(lanes)))} ranks: run on one of these, or "
            f"start the run with lanes= a multiple of {world} (the lanes are fixed for a run: "
            "its checkpoints record them)."
        )


def layout(items: int, global_batch: int, lanes: int, uneven: str) -> LaneLayout:
    """The lane layout of an epoch of ``items`` items (see the module docstring)."""
    batches = items // global_batch if uneven == "drop" else -(-items // global_batch)
    return LaneLayout(items, lanes, global_batch // lanes, batches)


def rank_lanes(lanes: int, rank: int, world: int) -> range:
    """The lanes rank ``rank`` of ``world`` reads (``world`` divides ``lanes``)."""
    m = lanes // world
    return range(rank * m, (rank + 1) * m)


def worker_lanes(mine: range, wid: int, nw: int) -> range:
    """Worker ``wid`` of ``nw``'s contiguous run of its rank's lanes ``mine`` (empty for some
    workers when there are more workers than lanes)."""
    m = len(mine)
    return range(mine.start + m * wid // nw, mine.start + m * (wid + 1) // nw)


def lane_start(lay: LaneLayout, lane: int) -> int:
    """The first position of ``lane`` in the epoch's order (positions wrap modulo ``items``)."""
    return lane * lay.length


def batch_part(lay: LaneLayout, lanes: range, k: int) -> list[int]:
    """The epoch positions lanes ``lanes`` give to global batch ``k``, in lane order."""
    n, b = max(lay.items, 1), lay.part
    return [(lane_start(lay, lane) + k * b + j) % n for lane in lanes for j in range(b)]


def run(lay: LaneLayout, lanes: range, first: int = 0) -> list[int]:
    """The positions lanes ``lanes`` read, batch by batch, from global batch ``first`` on."""
    return [p for k in range(first, lay.batches) for p in batch_part(lay, lanes, k)]


def default_lanes(global_batch: int, per_item: bool) -> int:
    """``lanes`` when not given: ``global_batch`` for files (a lane per sample of a batch:
    every world size dividing the global batch works), ``gcd(global_batch, 24)`` for rows
    (each lane holds a shuffle block in the worker reading it; 24 lanes work on 1, 2, 3, 4,
    6, 8, 12 and 24 ranks)."""
    return global_batch if per_item else math.gcd(global_batch, 24)


__all__ = [
    "LaneLayout",
    "batch_part",
    "check",
    "default_lanes",
    "lane_start",
    "layout",
    "rank_lanes",
    "run",
    "worker_lanes",
    "workable",
]
