"""Who reads which file when: epoch order, rank shares, worker plans, resume positions.

Pure functions over indexes and lists; this module imports neither torch nor fsspec, so the
partitioning can be checked (and reasoned about) without either.

- `epoch_order`: the order of the ``n`` listed files in an epoch, the same on every rank
  (sorted, or a permutation that depends only on ``seed`` and ``epoch``);
- `rank_share`: the strided share of one rank, padded (``"pad"``) or cut (``"drop"``) so
  every rank gets the same count;
- `worker_plan`: one DataLoader worker's part of its rank's share, and its sample quota
  when ``samples_per_rank`` is set;
- `progress_record` / `same_layout`: the JSON-able position of a pass (one entry
  per worker) that ``VolumeDataset.state_dict()`` saves.
"""

from __future__ import annotations

import functools
import json
import os
import random
from collections.abc import Sequence
from typing import Any, Literal, TypeVar

T = TypeVar("T")


def env_int(name: str, default: int) -> int:
    v = os.environ.get(name)
    return int(v) if v not in (None, "") else default


def rank_world(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """``(rank, world_size)``: the given values, else ``RANK``/``WORLD_SIZE`` from the
    environment (0 and 1 when unset)."""
    r = rank if rank is not None else env_int("RANK", 0)
    world = world_size if world_size is not None else env_int("WORLD_SIZE", 1)
    if not 0 <= r < world:
        raise ValueError(f"rank {r} is outside world size {world}")
    return r, world


def epoch_order(n: int, shuffle: bool, seed: int, epoch: int) -> list[int]:
    """Indexes ``0..n-1`` in the order of ``epoch`` (a seeded permutation when ``shuffle``)."""
    return list(_order(n, shuffle, seed, epoch))


@functools.lru_cache(maxsize=4)
def _order(n: int, shuffle: bool, seed: int, epoch: int) -> tuple[int, ...]:
    order = list(range(n))
    if shuffle:
        random.Random(f"gangrun:{seed}:{epoch}").shuffle(order)
    return tuple(order)


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


def progress_record(
    epoch: int, world: int, nw: int, files: int, seed: int, start: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A fresh position record of a pass (no worker has yielded yet), or a deep copy of
    ``start`` to continue from."""
    if start is not None:
        return json.loads(json.dumps(start))
    return {
        "epoch": epoch,
        "world_size": world,
        "num_workers": nw,
        "files": files,
        "seed": seed,
        "workers": [None] * nw,
    }


def same_layout(start: dict[str, Any] | None, world: int, nw: int) -> bool:
    """Whether position ``start`` was made with this world size and worker count (only then
    can each worker continue from its own entry)."""
    return start is not None and start.get("num_workers") == nw and start.get("world_size") == world


__all__ = [
    "env_int",
    "epoch_order",
    "progress_record",
    "rank_share",
    "rank_world",
    "same_layout",
    "worker_plan",
]
