"""The rest of an epoch after an interruption, continued on any number of ranks and workers.

A pass of an epoch is laid out by the world that reads it (`sharding` for files,
`table.plan` for table rows): every DataLoader worker of every rank reads its *run*, a
deterministic sequence of the epoch's items. A saved position is each worker's count of items
consumed (`VolumeDataset`: ``[file position, samples of it, yielded]``; `TableDataset`:
``[batches, rows]``), so the items the whole world consumed, and those it did not, follow from
the positions of all ranks together, in the epoch's own coordinates (file indexes, row
positions) rather than in any rank's.

**The rest.** `rest_files` / `rest_rows`: every item of the epoch that no worker of the saved
world consumed, once, in the epoch's order (a file partly read keeps the count of its samples
already read, and continues after them). Items the old world would have read twice at the
epoch's end (``uneven="pad"``) are kept once. The pass that continues lays *the rest* out for
its own world exactly as a fresh pass lays out an epoch (strided files, contiguous rows; padded
or cut at its end by the ``uneven``/``drop_last`` rules), so across the old and the new world
every item of the epoch is read exactly once, and the next epoch is what the new world reads
uninterrupted.

**The record.** A pass made from a rest keeps, under ``"base"``, what the rest was computed
from: ``{"scope": "world" | "rank", "ranks": {rank: saved record}}`` (``"world"``: the
positions of every rank of the saved world, when it had another size; ``"rank"``: this rank's
own, when only the worker count or batch size changed, so each rank continues its own share).
A record is thus self-contained: interrupted again, on yet another world, its rest is computed
the same way through its base. This module imports neither torch nor pyarrow (numpy only).
"""

from __future__ import annotations

import functools
import json
import warnings
from collections.abc import Callable, Mapping
from typing import Any, cast

from . import sharding
from .split import Position
from .table import plan

Record = Position
#: what a rest is computed from: ``{"scope", "ranks": {rank: Record}}``
Base = dict[str, Any]


def records_of(state: Mapping[str, Any]) -> dict[int, Record]:
    """The positions in a dataset's state: ``{rank: record}`` from its ``rank<R>`` keys (one
    key for a rank's own state; every rank's once a checkpoint saved by another number of
    ranks was restored, see `gangrun.checkpoint.state`)."""
    out: dict[int, Record] = {}
    for key, raw in state.items():
        if not (isinstance(key, str) and key.startswith("rank") and key[4:].isdigit()):
            continue
        rec = json.loads(raw) if isinstance(raw, (str, bytes)) else raw
        if isinstance(rec, dict):
            out[int(key[4:])] = cast(Record, rec)
    return out


def merged(recs: Mapping[int, Record]) -> Record:
    """A start made of every rank's saved record (``{"merged": {rank: record}}``, with the
    fields the datasets check)."""
    first: Mapping[str, Any] = recs[min(recs)]
    keep = ("epoch", "seed", "files", "rows", "table", "world_size")
    out = cast(Record, {k: first[k] for k in keep if k in first})
    out["merged"] = {str(r): recs[r] for r in sorted(recs)}
    return out


def plan_start(
    start: Record | None,
    rank: int,
    world: int,
    nw: int,
    same: Callable[[Record], bool],
    fresh: Callable[[], Record],
    what: str,
    warn: bool,
) -> Record | None:
    """The record a pass of ``nw`` workers on rank ``rank`` of ``world`` starts from, given the
    restored ``start``: ``start`` itself when it was made with this layout (``same``; each
    worker continues its own run); else a fresh record (``fresh()``) whose ``"base"`` is what
    the rest of the epoch is computed from; ``None`` (the epoch restarts, said once when
    ``warn``) when the positions of the saved world are not all at hand."""
    if start is None:
        return None
    if "merged" not in start and same(start):
        return start
    if "merged" in start:
        ranks = dict(start["merged"])
        saved = int(start.get("world_size") or len(ranks))
        own = ranks.get(str(rank))
        if saved == world and own is not None and same(own):
            return own  # every rank's position, on the same layout: each continues its own
    else:
        ranks = {str(rank): start}
        saved = int(start.get("world_size") or 1)
    if saved == world and str(rank) in ranks:
        base = {"scope": "rank", "ranks": {str(rank): ranks[str(rank)]}}
    elif len(ranks) == saved and all(str(r) in ranks for r in range(saved)):
        base = {"scope": "world", "ranks": ranks}
    else:
        if warn:
            warnings.warn(
                f"{what}: the saved position holds the progress of {len(ranks)} of the "
                f"{saved} ranks that saved it, not enough to continue the epoch on {world} "
                "rank(s); the epoch restarts from its beginning. (gangrun.Checkpointer restores "
                "every rank's position on another world size.)",
                stacklevel=5,
            )
        return None
    rec = fresh()
    rec["base"] = base
    return rec


# ---------------------------------------------------------------------------------- files


@functools.lru_cache(maxsize=8)
def _rest_files_cached(key: str) -> tuple[tuple[int, int], ...]:
    args = json.loads(key)
    return tuple(_rest_files(**args))


def file_runs(
    rec: Record, rank: int, n: int, shuffle: bool, seed: int, uneven: Any
) -> list[list[tuple[int, int]]]:
    """Each worker's run of the pass ``rec`` describes on ``rank``: ``(file index, samples
    already read)`` entries, in reading order."""
    world, nw = int(rec["world_size"]), int(rec["num_workers"])
    base = rec.get("base")
    if base is None:
        order = sharding.epoch_order(n, shuffle, seed, int(rec["epoch"]))
        share: list[tuple[int, int]] = [
            (f, 0) for f in sharding.rank_share(order, rank, world, uneven)
        ]
    else:
        rest = list(rest_files(base, n, shuffle, seed, uneven))
        if base["scope"] == "rank":
            share = rest
        else:
            share = sharding.rank_share(rest, rank, world, uneven) if rest else []
    return [share[w::nw] for w in range(nw)]


def rest_files(
    base: Base, n: int, shuffle: bool, seed: int, uneven: Any
) -> tuple[tuple[int, int], ...]:
    """The files of the epoch the world of ``base`` did not finish: ``(file index, samples of
    it already read)``, once each, in the epoch's order (see the module docstring)."""
    key = json.dumps(
        {"base": base, "n": n, "shuffle": shuffle, "seed": seed, "uneven": uneven},
        sort_keys=True,
    )
    return _rest_files_cached(key)


def _rest_files(base: Base, n: int, shuffle: bool, seed: int, uneven: Any) -> list[tuple[int, int]]:
    done: set[int] = set()
    read: dict[int, int] = {}  # file -> samples of it read (the most of any of its copies)
    left: list[tuple[int, int, int]] = []  # (place in the pass's order, file, samples read)
    for r, rec in base["ranks"].items():
        world, nw = int(rec["world_size"]), int(rec["num_workers"])
        runs = file_runs(rec, int(r), n, shuffle, seed, uneven)
        for w, run in enumerate(runs):
            p = rec["workers"][w] if w < len(rec["workers"]) else None
            fpos, k = (int(p[0]), int(p[1])) if p else (0, 0)
            for i, (f, skip) in enumerate(run):
                place = (i * nw + w) * world + int(r)
                if i < fpos:
                    done.add(f)
                    continue
                got = max(skip, k) if i == fpos else skip
                read[f] = max(read.get(f, 0), got)
                left.append((place, f, got))
    out: list[tuple[int, int]] = []
    seen: set[int] = set()
    for _, f, _ in sorted(left):
        if f in done or f in seen:
            continue
        seen.add(f)
        out.append((f, read[f]))
    return out


# ----------------------------------------------------------------------------------- rows


class RowSplit:
    """The row layout of a `TableDataset`'s epoch: positions ``0..rows-1`` in the epoch's
    unit order, each worker's run (`table.plan`), shuffled in blocks seeded by the run."""

    def __init__(
        self,
        rows: int,
        shuffle: bool,
        block: int,
        seed: int,
        uneven: Any,
        drop_last: bool,
    ) -> None:
        self.rows, self.shuffle, self.block, self.seed = rows, shuffle, block, seed
        self.uneven, self.drop_last = uneven, drop_last

    def _key(self) -> tuple[Any, ...]:
        return (self.rows, self.shuffle, self.block, self.seed, self.uneven, self.drop_last)

    def fresh_run(self, epoch: int, wpos: int, wrows: int) -> Any:
        """The epoch positions a fresh run ``(wpos, wrows)`` reads, in order (what
        `TableDataset`'s reader yields: blocks of the run permuted by their seeds)."""
        import numpy as np

        if wrows <= 0 or self.rows <= 0:
            return np.zeros(0, dtype=np.int64)
        if not self.shuffle:
            return (wpos + np.arange(wrows, dtype=np.int64)) % self.rows
        parts = []
        for j, lo, n, _ in plan.blocks(0, wrows, self.block):
            rng = np.random.default_rng(plan.block_seed(self.seed, epoch, wpos, j))
            perm = rng.permutation(n)
            perm += wpos + lo
            parts.append(perm % self.rows if wpos + lo + n > self.rows else perm)
        return np.concatenate(parts)

    def runs(self, rec: Record, rank: int) -> list[Any]:
        """Each worker's positions in the pass ``rec`` describes on ``rank``."""
        import numpy as np

        world, nw, bs = int(rec["world_size"]), int(rec["num_workers"]), int(rec["batch_size"])
        epoch = int(rec["epoch"])
        base = rec.get("base")
        if base is None:
            lay = plan.rank_layout(self.rows, rank, world, bs, self.uneven, self.drop_last)
            return [self.fresh_run(epoch, *plan.worker_range(lay, w, nw, bs)) for w in range(nw)]
        rest = self.rest(base)
        if base["scope"] == "rank":
            lay = plan.rank_layout(len(rest), 0, 1, bs, self.uneven, self.drop_last)
        else:
            lay = plan.rank_layout(len(rest), rank, world, bs, self.uneven, self.drop_last)
        out = []
        for w in range(nw):
            vpos, vrows = plan.worker_range(lay, w, nw, bs)
            if not len(rest) or vrows <= 0:
                out.append(np.zeros(0, dtype=np.int64))
            else:
                out.append(rest[(vpos + np.arange(vrows, dtype=np.int64)) % len(rest)])
        return out

    def rest(self, base: Base) -> Any:
        """The epoch positions the world of ``base`` did not consume, once each, in order."""
        key = json.dumps(base, sort_keys=True)
        return _rest_rows(self._key(), key)


@functools.lru_cache(maxsize=8)
def _rest_rows(split_key: tuple[Any, ...], base_key: str) -> Any:
    import numpy as np

    split = RowSplit(*split_key)
    base = json.loads(base_key)
    taken, left = [], []
    for r in sorted(base["ranks"], key=int):
        rec = base["ranks"][r]
        for w, pos in enumerate(split.runs(rec, int(r))):
            p = rec["workers"][w] if w < len(rec["workers"]) else None
            c = min(int(p[1]), len(pos)) if p else 0
            taken.append(pos[:c])
            left.append(pos[c:])
    rest = np.concatenate(left) if left else np.zeros(0, dtype=np.int64)
    seen = np.zeros(max(split.rows, 1), dtype=bool)
    if taken:  # a position a pad repeated may have been consumed by its other copy
        seen[np.concatenate(taken)] = True
    rest = rest[~seen[rest]]
    if len(rest) and np.bincount(rest, minlength=split.rows).max() > 1:  # repeats left
        _, first = np.unique(rest, return_index=True)
        rest = rest[np.sort(first)]
    rest.setflags(write=False)
    return rest


__all__ = ["RowSplit", "file_runs", "merged", "plan_start", "records_of", "rest_files"]
