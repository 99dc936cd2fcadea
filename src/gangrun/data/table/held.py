"""`TableDataset` with the global batch held: each worker reads its lanes' rows, batch by
batch (`gangrun.data.lanes`), and the loader joins the workers' parts.

A lane is a run of the epoch's rows as a DataLoader worker's run is without the global batch
held (contiguous positions in the row groups' order, shuffled in blocks of ``shuffle_buffer``
rows each permuted by a seed of its own, from the lane's first position: `table.plan`), so a
lane's order depends on the seed, the epoch and the lanes only, never on the world size or
the workers. A worker reads each of its lanes through its own reader (a row group is read by
the one worker whose lane holds it) and takes ``global_batch // lanes`` rows of each per batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from .. import lanes
from ..read_errors import read_error
from ..split import Position
from .convert import as_record_batch, convert
from .handover import WireChunk
from .source import READ_ERRORS


class _LaneRows:
    """The rows of one lane, taken ``n`` at a time (with the row groups they come from)."""

    def __init__(self, chunks: Iterator[tuple[Any, list[int]]]) -> None:
        self.chunks = chunks
        self.buf: list[Any] = []
        self.have = 0
        self.units: list[int] = []

    def take(self, n: int) -> tuple[list[Any], list[int]]:
        while self.have < n:
            got = next(self.chunks, None)
            if got is None:
                break
            table, units = got
            self.buf.append(table)
            self.have += table.num_rows
            self.units.extend(units)
        out, left = [], n
        while left and self.buf:
            head = self.buf[0]
            if head.num_rows <= left:
                out.append(head)
                self.buf.pop(0)
                left -= head.num_rows
            else:
                out.append(head.slice(0, left))
                self.buf[0] = head.slice(left)
                left = 0
        self.have -= n - left
        units, self.units = self.units, self.units[-1:]
        return out, units

    def close(self) -> None:
        close = getattr(self.chunks, "close", None)
        if close is not None:
            close()


def iterate(
    ds: Any,
    start: Position | None,
    tagged: bool,
    wid: int,
    nw: int,
    track: bool,
    chunks: Callable[[list[int], int, int, int], Iterator[tuple[Any, list[int]]]],
    place: Callable[[int], str],
    wire: bool = False,
) -> Iterator[Any]:
    """This worker's part of each global batch from the one ``start`` names, tagged
    ``(wid, batches done)``: converted to the dataset's output, or (``wire``, in a worker of
    `TableLoader`) in chunks of several parts (`table.handover`); a worker without lanes
    yields nothing. Iterated directly (``track``): the rank's batches, transformed, their
    position recorded. ``chunks(order, first position, rows, rows done)``: a run's rows (the
    dataset's reader); ``place(unit)``: how an error names a row group."""
    import pyarrow as pa
    from torch.utils.data import get_worker_info

    from .handover import CHUNK_BATCHES, CHUNK_BYTES, to_wire, to_wire_ipc

    info = get_worker_info()
    pickled = info is not None  # parts cross to the loader's process
    wire = wire and pickled
    lay, mine, first = ds.held_worker(start, wid, nw)
    if not mine:
        return
    order = ds.unit_order()
    b = lay.part
    rows = [
        _LaneRows(chunks(order, lanes.lane_start(lay, lane), lay.length, first * b))
        for lane in mine
    ]
    if track:
        ds.start_progress(1, start)
    pool = ds.pool_active if wire else None
    if pool is not None:
        pool.reclaim(wid)  # a persistent worker: its last pass's undelivered chunks
    group: list[Any] = []
    group_units: list[int] = []
    group_bytes, limit, at = 0, 1, first

    def named(units: list[int], error: Exception, doing: str) -> Exception:
        places = [place(u) for u in dict.fromkeys(units)]
        return read_error("TableDataset", places, error, ds.rank_world()[0], doing=doing)

    def flush() -> Any:
        nonlocal group, group_units, group_bytes, limit, at
        send = to_wire_ipc if ds.output == "arrow" else to_wire
        try:  # the hand-over converts the columns
            chunk = send(group, (at, 0), pool, wid)
        except READ_ERRORS as e:
            raise named(group_units, e, "could not hand over the rows of") from e
        at += len(group)
        group, group_units, group_bytes = [], [], 0
        limit = min(2 * limit, CHUNK_BATCHES)
        return chunk, (wid, at)

    try:
        for k in range(first, lay.batches):
            parts: list[Any] = []
            units: list[int] = []
            for lane in rows:
                got, used = lane.take(b)
                parts += got
                units += used
            table = pa.concat_tables(parts) if len(parts) > 1 else parts[0]
            if wire:
                if group and group_bytes + table.nbytes > CHUNK_BYTES:
                    yield flush()
                group.append(table)
                group_units.extend(units)
                group_bytes += table.nbytes
                if len(group) >= limit:
                    yield flush()
                continue
            try:
                out = convert(as_record_batch(table), ds.output, pickled)
            except READ_ERRORS as e:  # a damaged column: a string that is not UTF-8, ...
                raise named(units, e, "could not convert the rows of") from e
            if tagged:
                yield out, (wid, k + 1)
                continue
            if ds.transform is not None:
                out = ds.transform(out)
            if track:
                ds.record_progress(0, k + 1)
            yield out
        if group:
            yield flush()
    finally:
        for lane in rows:
            lane.close()


def turns(loader: Any, it: Iterator[Any], pool: Any) -> Iterator[Any]:
    """The rank's batches of a `TableLoader` pass: one part from each worker with lanes, in
    worker order (lane order), joined; the global batches consumed recorded as each batch is
    handed out. The parts come as the DataLoader delivers them (chunks of several, or
    alone), queued per worker."""
    from collections import deque

    ds = loader.table
    nw = max(1, int(loader.num_workers))
    lay = ds.lane_layout()
    rank, world = ds.rank_world()
    mine = lanes.rank_lanes(lay.lanes, rank, world)
    active = [w for w in range(nw) if len(lanes.worker_lanes(mine, w, nw))]
    queued: list[deque[Iterator[Any]]] = [deque() for _ in range(nw)]
    collate = loader.held_collate
    first = int((ds.position() or {}).get("batches") or 0)
    for _ in range(first, lay.batches):
        parts: list[Any] = []
        done: Any = None
        for w in active:
            got = None
            while got is None:
                q = queued[w]
                if q:
                    got = next(q[0], None)
                    if got is None:
                        q.popleft()
                    continue
                item, (wid, progress) = next(it)
                if isinstance(item, WireChunk):
                    queued[wid].append(iter(item.batches(pool)))
                else:
                    queued[wid].append(iter([(item, progress)]))
            parts.append(got[0])
            done = got[1]
        batch = collate(ds.held_join(parts))
        ds.record_progress(active[-1], done if isinstance(done, int) else int(done[0]))
        yield batch
    for _ in it:  # ends the DataLoader's pass (nothing is left)
        pass


def join(parts: list[Any], output: str) -> Any:
    """One batch of the workers' parts (``None``: a worker without lanes), in order."""
    parts = [p for p in parts if p is not None]
    if len(parts) == 1:
        return parts[0]
    if output == "arrow":
        import pyarrow as pa

        return pa.Table.from_batches(parts).combine_chunks().to_batches()[0]
    if output == "pandas":
        import pandas as pd

        return pd.concat(parts, ignore_index=True)
    out: dict[str, Any] = {}
    for name in parts[0]:
        cols = [p[name] for p in parts]
        if isinstance(cols[0], list):
            out[name] = [v for c in cols for v in c]
        elif output == "numpy":
            import numpy as np

            out[name] = np.concatenate(cols)
        else:
            import torch

            out[name] = torch.cat(cols)
    return out


__all__ = ["iterate", "join", "turns"]
