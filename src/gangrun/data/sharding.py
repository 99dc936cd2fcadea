"""Who reads which file when: epoch order, rank shares, worker plans.

Pure functions over indexes and lists; this module imports neither torch nor fsspec, so the
partitioning can be checked (and reasoned about) without either. What both datasets share
(the rank, the order's permutation, the position record) is `split`.

- `epoch_order`: the order of the ``n`` listed files in an epoch, the same on every rank
  (sorted, or a permutation that depends only on ``seed`` and ``epoch``: `split`);
- `rank_share`: the strided share of one rank, padded (``"pad"``) or cut (``"drop"``) so
  every rank gets the same count;
- `worker_plan`: one DataLoader worker's part of its rank's share, and its sample quota
  when ``samples_per_rank`` is set;
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, TypeVar

from . import split

T = TypeVar("T")


def epoch_order(n: int, shuffle: bool, seed: int, epoch: int) -> list[int]:
    """Indexes ``0..n-1`` (the listed files) in the order of ``epoch`` (`split.epoch_order`)."""
    return split.epoch_order(n, shuffle, seed, epoch, "files")


def rank_share(
    order: Sequence[T], rank: int, world: int, uneven: Literal["pad", "drop"]
) -> list[T]:
    """The indexes of ``order`` that ``rank`` reads: every ``world``-th from ``rank``, after
    padding the order with its first entries (``"pad"``) or cutting it (``"drop"``) to a
    multiple of ``world``, so every rank gets the same count."""
    items = list(order)
    n = len(items)
    if uneven == "drop":
        items = items[: (n // world) * world]
    elif n:
        need = -(-n // world) * world - n
        items = items + [items[i % n] for i in range(need)]
    return items[rank::world]


def worker_plan(
    rank_items: Sequence[T], wid: int, nw: int, samples_per_rank: int | None
) -> tuple[list[T], int | None]:
    """``(items, quota)`` of worker ``wid`` of ``nw``: its strided part of the rank's items,
    and, with ``samples_per_rank``, how many samples it yields (a worker left without items
    then cycles over the rank's items from a worker-dependent offset)."""
    items = list(rank_items[wid::nw])
    quota = None
    if samples_per_rank is not None:
        q = samples_per_rank
        quota = q // nw + (1 if wid < q % nw else 0)
        if not items and quota and rank_items:
            k = wid % len(rank_items)
            items = list(rank_items[k:]) + list(rank_items[:k])
    return items, quota


__all__ = ["epoch_order", "rank_share", "worker_plan"]
