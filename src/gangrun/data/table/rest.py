"""Reading the rest of a `TableDataset`'s epoch (`gangrun.data.elastic`): the rows at given
epoch positions, in that order."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from . import plan
from .source import Reader

if TYPE_CHECKING:
    import pyarrow as pa


def rows_at(
    ds: Any, unit_rows: list[int], positions: Any, keep: int = 4
) -> Iterator[tuple[pa.Table, list[int]]]:
    """Arrow tables of the rows at epoch ``positions``, in that order (the rest of an
    epoch, `elastic`), ``shuffle_buffer`` rows at a time: each row group they touch is
    read whole, and the last ``keep`` read are kept (the rest of a shuffled block spans
    the row groups of the next one too). ``unit_rows``: the rows of each row group."""
    import numpy as np
    import pyarrow as pa
    from torch.utils.data import get_worker_info

    order = ds.unit_order()
    rows = np.array([unit_rows[u] for u in order], dtype=np.int64)
    offsets = np.concatenate([np.zeros(1, dtype=np.int64), np.cumsum(rows)])
    where = np.searchsorted(offsets, positions, side="right") - 1
    size = max(1, ds.shuffle_buffer)
    groups = [
        (lo, where[lo : lo + size], np.unique(where[lo : lo + size]))
        for lo in range(0, len(positions), size)
    ]
    held: list[int] = []  # the row groups kept, oldest first (as `read` below keeps them)
    todo = []
    for _, _, uniq in groups:
        for i in uniq.tolist():
            if i in held:
                held.remove(i)
            else:
                todo.append(plan.Piece(order[i], 0, int(rows[i])))
            held = (held + [i])[-keep:]
    threads = get_worker_info() is None if ds.use_threads is None else ds.use_threads
    reader = Reader(ds, todo, bool(threads))
    kept: dict[int, pa.Table] = {}
    try:
        place = np.zeros(len(order), dtype=np.int64)
        for lo, ids, uniq in groups:
            parts = []
            for i in uniq.tolist():
                t = kept.pop(i, None)
                if t is None:
                    t = reader.read(plan.Piece(order[i], 0, int(rows[i])))
                kept[i] = t
                parts.append(t)
                while len(kept) > keep:
                    del kept[next(iter(kept))]
            place[uniq] = np.concatenate([[0], np.cumsum(rows[uniq])[:-1]])
            block = pa.concat_tables(parts) if len(parts) > 1 else parts[0]
            local = place[ids] + (positions[lo : lo + len(ids)] - offsets[ids])
            yield block.take(local), [order[i] for i in uniq.tolist()]
    finally:
        kept.clear()
        reader.close()


__all__ = ["rows_at"]
