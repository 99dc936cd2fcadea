"""What both datasets split the same way: the process's rank, an epoch's order, the position
record of a pass.

Pure functions over indexes; this module imports neither torch, fsspec nor pyarrow. The
dataset-specific splits build on it: `sharding` (a `VolumeDataset`'s files: strided rank
shares, worker plans), `table.plan` (a `TableDataset`'s rows: contiguous rank and worker
runs), `lanes` (either, with the global batch held), `elastic` (the rest of an epoch).

- `rank_world`: ``(rank, world_size)`` from the arguments, else ``RANK``/``WORLD_SIZE``;
  one of the two set without the other is an error (every process would read as rank 0 of 1,
  each the whole epoch, or could not know its share);
- `epoch_order`: the order of ``n`` items (files, or a table's row groups) in an epoch: a
  permutation that depends only on the seed and the epoch (each kind has its own stream,
  kept as it always was, so a saved position and an epoch's order never change);
- `Position` / `position` / `same_layout`: the JSON-able position of a pass that a dataset's
  ``state_dict()`` saves under its rank's key.
"""

from __future__ import annotations

import functools
import json
import os
import random
from typing import Any, Literal, TypedDict

Kind = Literal["files", "rows"]
# the seed strings of each kind's order: fixed (an epoch's order is part of a run's record)
_SALT: dict[str, str] = {"files": "gangrun", "rows": "gangrun-table"}


def rank_world(
    rank: int | None = None, world_size: int | None = None, what: str = "the dataset"
) -> tuple[int, int]:
    """``(rank, world_size)``: the arguments, else ``RANK``/``WORLD_SIZE`` (torchrun and
    gangrun set both; 0 and 1 when neither is set). One set without the other is a
    ``ValueError`` naming what to set."""
    env_r, env_w = os.environ.get("RANK") or None, os.environ.get("WORLD_SIZE") or None
    if rank is None and world_size is None and (env_r is None) != (env_w is None):
        have, lack = ("RANK", "WORLD_SIZE") if env_r is not None else ("WORLD_SIZE", "RANK")
        raise ValueError(
            f"{what}: {have} is set ({os.environ[have]}) but {lack} is not; set both "
            "(torchrun and gangrun do), or pass rank= and world_size= explicitly"
        )
    r = rank if rank is not None else int(env_r) if env_r is not None else 0
    world = world_size if world_size is not None else int(env_w) if env_w is not None else 1
    if world < 1 or not 0 <= r < world:
        raise ValueError(f"{what}: rank {r} is outside world size {world}")
    return r, world


def epoch_order(n: int, shuffle: bool, seed: int, epoch: int, kind: Kind) -> list[int]:
    """Indexes ``0..n-1`` in the order of ``epoch`` (a permutation seeded by ``seed``,
    ``epoch`` and the kind when ``shuffle``), the same on every rank."""
    return list(_order(n, shuffle, seed, epoch, kind))


@functools.lru_cache(maxsize=4)
def _order(n: int, shuffle: bool, seed: int, epoch: int, kind: Kind) -> tuple[int, ...]:
    order = list(range(n))
    if shuffle:
        random.Random(f"{_SALT[kind]}:{seed}:{epoch}").shuffle(order)
    return tuple(order)


class Position(TypedDict, total=False):
    """The position of a pass, as a dataset's ``state_dict()`` saves it (JSON) for its rank.

    Both datasets: ``epoch``, ``seed``, ``world_size``, ``num_workers`` (of the pass),
    ``workers`` (each DataLoader worker's progress, or None: ``[file position, samples of it,
    yielded]`` for files, ``[batches, rows]`` for a table), ``next`` (the worker the
    round-robin serves next). Its items: ``files`` (a `VolumeDataset`'s count) or ``rows``,
    ``batch_size`` and ``table`` (a `TableDataset`'s rows, batch size and fingerprint).
    A rest of an epoch: ``base`` (what it was computed from), ``merged`` (every rank's
    record, restored onto another world size). The global batch held: ``held``
    (``{"global_batch", "lanes"}``) and ``batches`` (global batches the world consumed)."""

    epoch: int
    seed: int
    world_size: int
    num_workers: int
    workers: list[Any]
    next: int
    files: int
    rows: int
    batch_size: int
    table: str
    base: dict[str, Any]
    merged: dict[str, Any]
    held: dict[str, int]
    batches: int


def position(
    epoch: int,
    world: int,
    nw: int,
    seed: int,
    *,
    files: int | None = None,
    rows: int | None = None,
    batch_size: int | None = None,
    table: str | None = None,
) -> Position:
    """A fresh position of a pass of ``nw`` workers on ``world`` ranks (no worker has yielded
    yet); ``files`` for a `VolumeDataset`, ``rows``, ``batch_size``, ``table`` for a
    `TableDataset`."""
    rec = Position(epoch=epoch, world_size=world, num_workers=nw, seed=seed)
    if files is not None:
        rec["files"] = files
    if rows is not None:
        rec["rows"] = rows
    if batch_size is not None:
        rec["batch_size"] = batch_size
    if table is not None:
        rec["table"] = table
    rec["workers"] = [None] * nw
    return rec


def copied(start: Position | dict[str, Any]) -> Position:
    """A deep copy of a position (a pass continues from it without changing the saved one)."""
    out: Position = json.loads(json.dumps(start))
    return out


def same_layout(
    start: Position | dict[str, Any] | None, world: int, nw: int, batch_size: int | None = None
) -> bool:
    """Whether ``start`` was made with this world size and worker count (and batch size, for
    a table): only then can each worker continue from its own entry."""
    return (
        start is not None
        and start.get("num_workers") == nw
        and start.get("world_size") == world
        and (batch_size is None or start.get("batch_size") == batch_size)
    )


__all__ = ["Position", "copied", "epoch_order", "position", "rank_world", "same_layout"]
