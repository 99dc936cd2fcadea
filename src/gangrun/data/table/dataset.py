"""`TableDataset`: batches of a Parquet or Delta Lake table, split exactly across ranks
and DataLoader workers, shuffled per epoch, streamed through the node's cache, resumable.

The split arithmetic is `table.plan` (pure); what the table is made of and how a row
group is read is `table.source` (and `table.delta` for Delta snapshots); turning
Arrow batches into tensors is `table.convert`, handing them over from DataLoader workers
`table.handover`. The resume API is the one
[`VolumeDataset`][gangrun.data.VolumeDataset] has, so `VolumeLoader` and
``gangrun.checkpoint`` treat both alike.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal

from torch.utils.data import IterableDataset

from .. import elastic, split
from ..cache import parse_size
from ..listing import LOCAL_PROTOCOLS
from ..loader import keep_workers_by_default
from ..read_errors import place, read_error
from ..resumable import ResumableEpochs
from ..split import Position
from . import held, plan, rest
from .convert import OUTPUTS, as_record_batch, convert
from .delta import resolve
from .handover import CHUNK_BATCHES, CHUNK_BYTES, BlockPool, to_wire, to_wire_ipc
from .loader import TableLoader
from .loader import identity as _identity
from .source import READ_ERRORS, FileAccess, Reader, TableError, expression, fingerprint, plan_units

if TYPE_CHECKING:
    import pyarrow as pa

_DAMAGED = (
    "The row group's data is damaged (e.g. a string column that is not UTF-8): check it "
    "(pyarrow.parquet.ParquetFile(path).read_row_group(n).validate(full=True)), rewrite or "
    "remove the file, and run again."
)


class TableDataset(ResumableEpochs, IterableDataset):
    """An iterable dataset of batches of a Parquet or Delta Lake table.

    Args:
        source: a Parquet file, a directory of them, a glob, a list of files, or a Delta
            table's directory; a local path or any fsspec URL (``s3://``, ``gs://``, ...).
        format: ``"auto"`` (default: Delta when the directory has a ``_delta_log``),
            ``"parquet"`` or ``"delta"``.
        columns: the columns to read (default all); only these are read from storage.
        filter: a row filter, pushed down to the Parquet reader: a
            ``pyarrow.compute.Expression`` (``pc.field("x") > 0``) or DNF tuples
            (``[("x", ">", 0)]``). The rows that pass are counted when the dataset is made
            (reading only the filter's columns), so the split stays exact.
        batch_size: rows per batch (the dataset batches; its loader passes batches through);
            default 1024, or each rank's share of ``global_batch_size``.
        drop_last: drop each rank's last, short batch (all ranks alike).
        uneven: ``"pad"`` (default: every rank reads ``ceil(N / world)`` rows; the last
            ranks' shares wrap around to the start of the epoch, so at most ``world - 1``
            rows are read twice and none is skipped) or ``"drop"`` (every rank reads
            ``N // world`` rows; the last ``N % world`` rows of the epoch's order are skipped).
        shuffle: shuffle every epoch: the row groups' order, then rows within blocks of
            ``shuffle_buffer`` rows (a bounded buffer); reproducible from ``seed`` and the
            epoch, different per epoch.
        seed: seed of the shuffle.
        shuffle_buffer: rows per shuffle block (memory: about one block per worker).
        output: ``"torch"`` (default: dict of column -> tensor, zero-copy where Arrow's layout
            allows, lists for strings and nested types), ``"numpy"``, ``"arrow"`` (a
            ``pyarrow.RecordBatch``) or ``"pandas"``.
        transform: applied to every batch, after ``output``.
        version, timestamp: Delta time travel (a version number, or a ``datetime`` / ISO
            string: the version current then).
        cache, cache_dir, cache_limit: the node's cache of remote files, as for
            [`VolumeDataset`][gangrun.data.VolumeDataset] (files are streamed to disk, not memory).
        prefetch: remote files filled into the cache ahead of the reader (default 2).
        use_threads: pyarrow decoding threads (default: in the training process only, not in
            DataLoader workers, which are parallel already).
        rank, world_size: override ``RANK``/``WORLD_SIZE`` (otherwise from the environment;
            one set without the other is an error).
        storage_options: fsspec options (e.g. ``{"endpoint_url": ..., "key": ..., ...}``);
            for Delta they are translated for ``deltalake``; ``delta_storage_options`` adds
            or overrides ``deltalake`` options.
        global_batch_size: hold the global batch: each rank's batch ``k`` is its share
            (``global_batch_size // world_size`` rows) of global batch ``k``, the same set of
            rows on every world size that divides ``lanes``, and a resume on another size
            continues at the global batch where the world stopped (`gangrun.data.lanes`).
            Every global batch is full (``uneven``: the epoch's last, short one dropped or
            padded from the epoch's beginning). Default: each rank reads its own share.
        lanes: the epoch's canonical lanes with ``global_batch_size`` (default
            ``gcd(global_batch_size, 24)``); each holds a shuffle block in the worker reading
            it. Fixed for a run: the world sizes it can run on divide it.

    Raises ``TableError`` (a ``ValueError``) when the dataset is made: missing column, files
    with different schemas, an empty table, a Delta version that does not exist, a path that
    is not a table, a Delta feature it cannot read correctly. A file that cannot be read
    (a damaged page, a file gone since it was listed) raises
    `gangrun.data.DataReadError` naming the file, the row group and the rank.
    """

    def __init__(
        self,
        source: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        *,
        format: Literal["auto", "parquet", "delta"] = "auto",
        columns: Sequence[str] | None = None,
        filter: Any = None,
        batch_size: int | None = None,
        drop_last: bool = False,
        uneven: Literal["pad", "drop"] = "pad",
        shuffle: bool = False,
        seed: int = 0,
        shuffle_buffer: int = 65536,
        output: Literal["torch", "numpy", "arrow", "pandas"] = "torch",
        transform: Callable[[Any], Any] | None = None,
        version: int | None = None,
        timestamp: Any = None,
        cache: bool | Literal["auto"] = "auto",
        cache_dir: str | os.PathLike[str] | None = None,
        cache_limit: int | str | None = None,
        prefetch: int | None = None,
        use_threads: bool | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        storage_options: dict[str, Any] | None = None,
        delta_storage_options: dict[str, str] | None = None,
        global_batch_size: int | None = None,
        lanes: int | None = None,
    ) -> None:
        super().__init__()
        if uneven not in ("pad", "drop"):
            raise ValueError(f"uneven must be 'pad' or 'drop', got {uneven!r}")
        if output not in OUTPUTS:
            raise ValueError(f"output must be one of {', '.join(OUTPUTS)}, got {output!r}")
        self._rank, self._world_size = rank, world_size
        _, world = split.rank_world(rank, world_size, "TableDataset")  # RANK alone: an error now
        if global_batch_size is not None:
            share = int(global_batch_size) // world
            if batch_size is not None and int(batch_size) != share:
                raise ValueError(
                    f"TableDataset: batch_size={batch_size} with global_batch_size="
                    f"{global_batch_size}: each of the {world} ranks' batches is its share "
                    f"({share} rows); give one of the two"
                )
            batch_size = max(1, share)
        batch_size = 1024 if batch_size is None else batch_size
        if int(batch_size) < 1 or int(shuffle_buffer) < 1:
            raise ValueError("batch_size and shuffle_buffer must be >= 1")
        self.source = source
        self.batch_size = int(batch_size)
        self.drop_last = bool(drop_last)
        self.uneven = uneven
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.shuffle_buffer = int(shuffle_buffer)
        self.output = output
        self.transform = transform
        self.use_threads = use_threads
        self.storage_options = dict(storage_options or {})
        self.filter = expression(filter)
        self.table = resolve(
            source, format, self.storage_options, version, timestamp, delta_storage_options
        )
        remote = self.table.protocol not in LOCAL_PROTOCOLS
        cached = remote if cache == "auto" else bool(cache)
        self.prefetch = 2 if prefetch is None else int(prefetch)
        self.file_access = FileAccess(
            self.table.protocol,
            self.storage_options,
            cached,
            os.fspath(cache_dir) if cache_dir is not None else None,
            parse_size(cache_limit),
        )
        self.schema, self.columns, self.units = plan_units(
            self.table, self.file_access, columns, self.filter
        )
        self.rows = sum(n for _, _, n in self.units)
        self.fingerprint = fingerprint(self.table, self.units, f"{self.filter}")
        self._unit_rows = [n for _, _, n in self.units]
        self._epoch = 0
        self._resume: split.Position | None = None
        self._live: split.Position | None = None
        self._held_init(global_batch_size, lanes, per_item=False)
        self.pool: BlockPool | None = None  # TableLoader's shared memory blocks (kept)
        self.pool_active: BlockPool | None = None  # lent to the pass whose workers run now

    # -- the split -----------------------------------------------------------------------------

    def rank_world(self) -> tuple[int, int]:
        """``(rank, world_size)`` this dataset splits for (arguments, else the environment)."""
        return split.rank_world(self._rank, self._world_size, "TableDataset")

    def layout(self, rank: int | None = None) -> plan.Layout:
        """Rank ``rank``'s share of the epoch (first position, rows, batches)."""
        r, world = self.rank_world()
        r = r if rank is None else rank
        return plan.rank_layout(self.rows, r, world, self.batch_size, self.uneven, self.drop_last)

    def __len__(self) -> int:
        """Batches per rank and epoch (the same on every rank)."""
        if self.held is not None:
            return int(self.lane_layout().batches)
        return self.layout().batches

    def _items(self) -> int:
        return self.rows

    def unit_order(self, epoch: int | None = None) -> list[int]:
        """The order of the row groups in ``epoch`` (the same on every rank)."""
        e = self._epoch if epoch is None else epoch
        return plan.unit_order(len(self.units), self.shuffle, self.seed, e)

    # -- reading -------------------------------------------------------------------------------

    def _chunks(
        self, order: list[int], wpos: int, wrows: int, done: int
    ) -> Iterator[tuple[pa.Table, list[int]]]:
        """Arrow tables holding the worker run's rows from row ``done`` on, in order, each
        with the units (row groups) its rows come from."""
        import numpy as np
        import pyarrow as pa

        # a resumed shuffled run re-reads its current block from the block's start
        begin = done - done % self.shuffle_buffer if self.shuffle else done
        from torch.utils.data import get_worker_info

        threads = get_worker_info() is None if self.use_threads is None else self.use_threads
        todo = plan.pieces(order, self._unit_rows, wpos + begin, wrows - begin)
        reader = Reader(self, todo, bool(threads))
        try:
            if not self.shuffle:
                for p in reader.todo:
                    yield reader.read(p), [p.unit]
                return
            for j, lo, n, skip in plan.blocks(done, wrows, self.shuffle_buffer):
                todo = plan.pieces(order, self._unit_rows, wpos + lo, n)
                parts = [reader.read(p) for p in todo]
                block = pa.concat_tables(parts) if len(parts) > 1 else parts[0]
                rng = np.random.default_rng(plan.block_seed(self.seed, self._epoch, wpos, j))
                yield block.take(rng.permutation(n)[skip:]), [p.unit for p in todo]
        finally:
            reader.close()

    def _batches(
        self,
        chunks: Callable[[int], Iterator[tuple[pa.Table, list[int]]]],
        done: Sequence[int] | None,
        wire: bool = False,
    ) -> Iterator[tuple[Any, Any]]:
        """``(batch, (batches done, rows done))`` of one worker run (``chunks(rows done)``:
        its rows from there on), from progress ``done``;
        ``wire`` (in a worker of `TableLoader`): ``(WireChunk, progress after it)``
        items of several batches each instead."""
        import pyarrow as pa
        from torch.utils.data import get_worker_info

        nb, nr = (list(done) + [0, 0])[:2] if done else (0, 0)
        info = get_worker_info()
        in_worker = info is not None
        wire = wire and in_worker
        pool = self.pool_active if wire else None
        wid = info.id if info is not None else 0
        if pool is not None:
            pool.reclaim(wid)  # a persistent worker: its last pass's undelivered chunks
        bs = self.batch_size
        buf: list[pa.Table] = []
        have = 0
        group: list[pa.Table] = []  # wire: batches not handed over yet
        group_bytes = 0
        limit = 1  # wire: batches in the next chunk (1, 2, 4, ...: the first batch comes early)
        start = (nb, nr)
        buf_units: list[int] = []  # the row groups the rows of buf (and group) come from
        group_units: list[int] = []

        def named(units: list[int], error: Exception, doing: str) -> Exception:
            places = [self._place(u) for u in units]
            rank = self.rank_world()[0]
            return read_error("TableDataset", places, error, rank, doing=doing, hint=_DAMAGED)

        def emit() -> tuple[Any, Any]:
            nonlocal nb, nr, buf, have, buf_units
            units, buf_units = buf_units, []
            table = buf[0] if len(buf) == 1 else pa.concat_tables(buf)
            buf, have = [], 0
            try:
                out = convert(as_record_batch(table), self.output, in_worker)
            except READ_ERRORS as e:  # a damaged column: a string that is not UTF-8, ...
                raise named(units, e, "could not convert the rows of") from e
            if self.transform is not None:
                out = self.transform(out)
            nb, nr = nb + 1, nr + table.num_rows
            return out, (nb, nr)

        def flush() -> tuple[Any, Any]:
            nonlocal group, group_bytes, start, limit, group_units
            try:
                chunk = (to_wire_ipc if self.output == "arrow" else to_wire)(
                    group, start, pool, wid
                )
            except READ_ERRORS as e:  # as in emit: the hand-over converts the columns
                raise named(group_units, e, "could not hand over the rows of") from e
            group, group_bytes, start, group_units = [], 0, (nb, nr), []
            limit = min(2 * limit, CHUNK_BATCHES)
            return chunk, (nb, nr)

        def add() -> Iterator[tuple[Any, Any]]:
            nonlocal nb, nr, buf, have, group_bytes, buf_units
            if not wire:
                yield emit()
                return
            table = buf[0] if len(buf) == 1 else pa.concat_tables(buf)
            buf, have = [], 0
            units, buf_units = buf_units, []
            if group and group_bytes + table.nbytes > CHUNK_BYTES:
                yield flush()
            group.append(table)
            group_units.extend(units)
            group_bytes += table.nbytes
            nb, nr = nb + 1, nr + table.num_rows
            if len(group) >= limit:
                yield flush()

        for chunk, units in chunks(nr):
            off = 0
            while off < chunk.num_rows:
                take = min(bs - have, chunk.num_rows - off)
                buf.append(chunk.slice(off, take))
                buf_units.extend(units)
                have += take
                off += take
                if have == bs:
                    yield from add()
        if have:
            yield from add()
        if group:
            yield flush()

    def _place(self, unit: int) -> str:
        """How an error names row group ``unit`` (its file and index in the file)."""
        f, g, _ = self.units[unit]
        return place(self.table.files[f].path, g)

    def _iterate(self, start: Position | None, tagged: bool, wire: bool = False) -> Iterator[Any]:
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        if self.held is not None:
            track = info is None and not tagged
            yield from held.iterate(
                self, start, tagged, wid, nw, track, self._chunks, self._place, wire
            )
            return
        rank, _ = self.rank_world()
        start = self._plan(start, nw, warn=info is None or info.id == 0)
        wid = self._logical_worker(wid, nw, start)
        wstart = start["workers"][wid] if start is not None else None
        chunks: Callable[[int], Iterator[tuple[pa.Table, list[int]]]]
        if start is not None and start.get("base") is not None:  # the rest of an epoch
            positions = self._split().runs(start, rank)[wid]

            def chunks(done: int) -> Iterator[tuple[pa.Table, list[int]]]:
                return rest.rows_at(self, self._unit_rows, positions[done:])
        else:
            wpos, wrows = plan.worker_range(self.layout(), wid, nw, self.batch_size)

            def chunks(done: int) -> Iterator[tuple[pa.Table, list[int]]]:
                return self._chunks(self.unit_order(), wpos, wrows, done)

        track = info is None and not tagged
        if track:
            self.start_progress(1, start)
        yield from self._deliver(self._batches(chunks, wstart, wire), wid, tagged, track)

    def _split(self) -> elastic.RowSplit:
        return elastic.RowSplit(
            self.rows, self.shuffle, self.shuffle_buffer, self.seed, self.uneven, self.drop_last
        )

    def _plan(self, start: Position | None, nw: int, warn: bool) -> Position | None:
        """The record a pass of ``nw`` workers starts from: ``start`` on the same layout, the
        rest of the epoch on another (`elastic`), or ``None`` (a fresh epoch)."""
        if self.held is not None:  # the global batch index: the same on any layout
            return start
        _, world = self.rank_world()
        return self._planned(
            start,
            nw,
            lambda s: self._same_layout(s, world, nw),
            lambda: self._position(world, nw),
            warn,
        )

    def iter_wire(self, start: Position | None) -> Iterator[Any]:
        """What `TableLoader`'s workers iterate: ``(WireChunk, (worker, progress))`` items."""
        return self._iterate(start, tagged=True, wire=True)

    # -- resumable state (the protocol of VolumeDataset) ---------------------------------------
    #
    # A position is JSON: {"epoch", "world_size", "num_workers", "rows", "seed", "batch_size",
    # "table" (fingerprint of files, row groups, filter), "workers": [[batches, rows] yielded
    # by each DataLoader worker, or None]}.

    def _same_layout(self, start: Position | None, world: int, nw: int) -> bool:
        return split.same_layout(start, world, nw, self.batch_size)

    def resume_position(self) -> Position | None:
        """Take the position restored by `load_state_dict`, once (``None`` when nothing
        was restored, or, with a warning, when it does not match this table and epoch)."""
        start, self._resume = self._resume, None
        if start is None:
            return None
        if (
            start.get("epoch") != self._epoch
            or start.get("rows") != self.rows
            or start.get("table") != self.fingerprint
        ):
            warnings.warn(
                "TableDataset: the saved position does not match this dataset (epoch, table "
                "version, files or filter changed); the epoch restarts from its beginning.",
                stacklevel=3,
            )
            return None
        return start if self._held_matches(start) else None

    def held_join(self, parts: list[Any]) -> Any:
        """The rank's batch of its workers' parts (the global batch held), transformed."""
        out = held.join(parts, self.output)
        return self.transform(out) if self.transform is not None else out

    def _rest_size(self, base: dict[str, Any]) -> tuple[int, int, str]:
        return len(self._split().rest(base)), self.rows, "rows"

    def start_progress(self, num_workers: int, start: Position | None = None) -> None:
        """Begin recording a pass read by ``num_workers`` workers (1: in this process), from
        ``start`` (on another world size, worker count or batch size: the rest of its epoch,
        `elastic`)."""
        _, world = self.rank_world()
        nw = max(1, int(num_workers))
        if self.held is not None:
            fields = {"rows": self.rows, "table": self.fingerprint}
            self._live = self._held_record(nw, start, **fields)
            return
        planned = self._plan(start, nw, warn=False)
        if planned is not None and planned.get("base") is not None:  # the rest, computed once
            self._split().runs(planned, self.rank_world()[0])  # (workers forked after inherit it)
        self._live = split.copied(planned) if planned is not None else self._position(world, nw)

    def _position(self, world: int, nw: int) -> split.Position:
        """A fresh position record of a pass (`split.Position`)."""
        return split.position(
            self._epoch,
            world,
            nw,
            self.seed,
            rows=self.rows,
            batch_size=self.batch_size,
            table=self.fingerprint,
        )

    def loader(self, **dataloader_kwargs: Any) -> TableLoader:
        """A ``DataLoader`` over this dataset's batches that keeps `state_dict` exact
        (``num_workers``, ``pin_memory``, ... as usual; the batch size is the dataset's;
        workers are kept across epochs unless ``persistent_workers=False``)."""
        if dataloader_kwargs.pop("batch_size", None) is not None:
            raise ValueError("TableDataset batches itself: give batch_size= to TableDataset")
        dataloader_kwargs.setdefault("collate_fn", _identity)
        return TableLoader(self, batch_size=None, **keep_workers_by_default(dataloader_kwargs))

    def __repr__(self) -> str:
        return (
            f"TableDataset({self.table.description}, rows={self.rows}, "
            f"row_groups={len(self.units)}, columns={self.columns}, batch_size="
            f"{self.batch_size}, shuffle={self.shuffle}, uneven={self.uneven!r})"
        )


__all__ = ["TableDataset", "TableError", "TableLoader"]
