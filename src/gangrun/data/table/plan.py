"""Who reads which rows of a table when: the split arithmetic of `TableDataset`.

Pure functions over row counts; this module imports neither torch nor pyarrow, so the split
can be checked without either.

A table is a list of *units* (one Parquet row group each, in file order), unit ``u`` holding
``rows[u]`` rows (the rows that pass the filter, when there is one). An epoch:

1. orders the units (`unit_order`: file order, or a permutation seeded by
   ``(seed, epoch)``: `split`, which also gives the rank and the position record) and lays their rows end to end: positions ``0..N-1``;
2. gives rank ``r`` the contiguous positions ``[r*R, (r+1)*R)`` (`rank_range`), with
   ``R = ceil(N / world)`` and positions past ``N`` wrapping to the start (``uneven="pad"``:
   at most ``world - 1`` rows are read twice, none is skipped) or ``R = N // world``
   (``uneven="drop"``: the last ``N % world`` positions of the epoch are not read);
3. cuts the rank's ``R`` rows into batches of ``batch_size`` (the last one short, or dropped
   with ``drop_last``) and gives DataLoader worker ``w`` of ``nw`` a contiguous run of them
   (`worker_range`); every rank has the same layout, so every rank yields the same
   number of batches, of the same sizes;
4. maps a worker's positions back to row ranges of units (`pieces`), read in order, in
   shuffle blocks of ``shuffle_buffer`` rows, each permuted by its own seed
   (`block_permutation`), so that a worker that has yielded ``k`` rows can resume at
   block ``k // S``, offset ``k % S`` without reading what came before.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Sequence
from typing import Literal, NamedTuple

from .. import split


class Piece(NamedTuple):
    """Rows ``[start, start + length)`` of unit ``unit`` (counted after the filter)."""

    unit: int
    start: int
    length: int


class Layout(NamedTuple):
    """A rank's share of an epoch: its first position, rows read, batches, per-worker runs."""

    start: int
    rows: int
    batches: int


def unit_order(n: int, shuffle: bool, seed: int, epoch: int) -> list[int]:
    """Unit indexes ``0..n-1`` in the order of ``epoch`` (`split.epoch_order`)."""
    return split.epoch_order(n, shuffle, seed, epoch, "rows")


def rank_layout(
    total: int,
    rank: int,
    world: int,
    batch_size: int,
    uneven: Literal["pad", "drop"],
    drop_last: bool,
) -> Layout:
    """Rank ``rank``'s positions and batch count (the same counts on every rank)."""
    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    per = -(-total // world) if uneven == "pad" else total // world
    batches = per // batch_size if drop_last else -(-per // batch_size)
    return Layout(rank * per, min(per, batches * batch_size), batches)


def worker_range(layout: Layout, wid: int, nw: int, batch_size: int) -> tuple[int, int]:
    """``(first position, rows)`` of worker ``wid`` of ``nw``: a contiguous run of whole
    batches of its rank (only the worker with the rank's last batch may get a short one)."""
    b0 = layout.batches * wid // nw
    b1 = layout.batches * (wid + 1) // nw
    lo = b0 * batch_size
    hi = min(b1 * batch_size, layout.rows)
    return layout.start + lo, max(0, hi - lo)


def worker_batches(layout: Layout, wid: int, nw: int) -> int:
    """How many batches worker ``wid`` of ``nw`` yields."""
    return layout.batches * (wid + 1) // nw - layout.batches * wid // nw


def pieces(order: Sequence[int], rows: Sequence[int], start: int, length: int) -> list[Piece]:
    """The unit row ranges of epoch positions ``[start, start + length)``, in order;
    positions ``>= N`` wrap to the start of the epoch (padding)."""
    total = sum(rows[u] for u in order)
    out: list[Piece] = []
    if length <= 0 or total == 0:
        return out
    pos = start % total
    left = length
    # find the unit holding `pos`
    offsets = []
    acc = 0
    for u in order:
        offsets.append(acc)
        acc += rows[u]
    i = bisect.bisect_right(offsets, pos) - 1
    while left > 0:
        u = order[i]
        inner = pos - offsets[i]
        take = min(rows[u] - inner, left)
        if take > 0:
            out.append(Piece(u, inner, take))
            left -= take
            pos += take
        i += 1
        if i == len(order):  # wrap around (padding)
            i, pos = 0, 0
    return out


def block_seed(seed: int, epoch: int, start: int, block: int) -> int:
    """The 63-bit seed of shuffle block ``block`` of the worker run starting at epoch position
    ``start`` (depends only on these numbers; the reader permutes the block's rows with it)."""
    return random.Random(f"gangrun-table-block:{seed}:{epoch}:{start}:{block}").getrandbits(63)


def blocks(done: int, rows: int, size: int) -> list[tuple[int, int, int, int]]:
    """The shuffle blocks of a worker run of ``rows`` rows still to read after ``done``:
    ``(block index, first row in the run, rows in the block, rows of it already yielded)``."""
    out: list[tuple[int, int, int, int]] = []
    j = done // size
    while j * size < rows and done < rows:
        lo = j * size
        out.append((j, lo, min(size, rows - lo), max(0, done - lo)))
        j += 1
    return out


__all__ = [
    "Layout",
    "Piece",
    "block_seed",
    "blocks",
    "pieces",
    "rank_layout",
    "unit_order",
    "worker_batches",
    "worker_range",
]
