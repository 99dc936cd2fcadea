"""How `TableLoader`'s DataLoader workers hand batches to the training process.

A worker groups consecutive batches into a `WireChunk` (up to ``CHUNK_BYTES`` or
``CHUNK_BATCHES``; the first chunks of a run are smaller, so the first batch comes early):
the DataLoader's hand-over costs about the same per item whatever its size.

The chunk's columns travel, cheapest first:

- in a `BlockPool` block: shared memory the training process made once (before the workers
  fork, so they inherit it) and keeps across epochs. The worker copies the batches' columns
  straight from the decoded Arrow buffers into a free block (one copy, no new shared memory,
  no file descriptor to pass); the message is a few numbers. The training process hands out
  tensors that are views of the block and frees the block when the last of them is gone
  (a ``weakref.finalize`` on the chunk's array), so a block is never rewritten while a batch
  the training loop still holds lives in it;
- else (no free block, a chunk bigger than a block, a worker started by ``spawn``) in a fresh
  shared memory segment (large chunks) or pickled through the DataLoader's pipe (small ones).

Strings, nested columns and columns with nulls travel as Python lists (see
`table.convert.column_array`). For ``output="arrow"`` (`to_wire_ipc`) the chunk is the
batches' Arrow IPC stream, written straight into the block (every type, nulls included);
the training process reads the record batches from the block without a copy.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa

from .convert import as_tensors, column_array

#: A DataLoader worker hands batches over in chunks of at most about this many bytes (a
#: bigger batch travels alone) or ``CHUNK_BATCHES`` batches.
CHUNK_BYTES = 4 << 20
CHUNK_BATCHES = 32
#: below this many bytes a chunk that found no pool block travels pickled through the
#: DataLoader's pipe (one copy, no shared memory segment to create and pass); above, in one
#: fresh shared memory segment.
PIPE_BYTES = 2 << 20
_ALIGN = 64


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _no_pool() -> None:
    return None


class BlockPool:
    """Blocks of shared memory for the chunks of ``workers`` DataLoader workers,
    ``per_worker`` blocks of ``block_bytes`` each; made in the training process.

    A block's state (shared, one byte) is 0 when free, 1 from the moment a worker takes it
    until the training process maps it, 2 from then until the training process has dropped
    every batch that lives in it. A block the training process never maps (the chunk was
    dropped: a pass left midway) is free again when the pool is lent to the next pass (its
    workers are gone) or, for persistent workers, when its worker starts its next pass
    (`reclaim`: the worker's chunks of the last pass are all sent by then, and the loader
    drops them unread). Pickled (a worker started by ``spawn``), the pool becomes ``None``:
    that worker uses the fallbacks.
    """

    def __init__(self, workers: int, per_worker: int, block_bytes: int = CHUNK_BYTES) -> None:
        import torch

        n = workers * per_worker
        self.workers, self.per_worker, self.block_bytes = workers, per_worker, block_bytes
        self._owner = os.getpid()

        def shared(nbytes: int) -> Any:
            storage = torch.UntypedStorage._new_shared(nbytes)
            return torch.empty(0, dtype=torch.uint8).set_(storage)

        self._tensors = [shared(n)] + [shared(block_bytes) for _ in range(n)]
        self.state = self._tensors[0].numpy()
        self.state[:] = 0
        blocks = [t.numpy() for t in self._tensors[1:]]
        for b in blocks:
            b.fill(0)  # the pages exist from now on: workers of later epochs only map them
        self._views = [memoryview(b) for b in blocks]
        self._blocks = blocks
        self.held: set[int] = set()  # blocks the training process still hands batches from
        self.lent = False
        self._holder: Any = None  # persistent workers: a weak reference to their iterator

    def __reduce__(self) -> Any:
        return _no_pool, ()

    # -- in the training process ---------------------------------------------------------------

    @property
    def busy(self) -> bool:
        """Lent to a pass, or to persistent workers whose DataLoader iterator still lives."""
        if self.lent and self._holder is not None and self._holder() is None:
            self.give_back()  # the iterator is gone: its workers were shut down
        return self.lent

    def lend(self) -> bool:
        """Take the pool for one pass of the loader (False: another pass holds it). No
        worker of an earlier pass is alive now: blocks it took but never delivered are free."""
        if self.busy:
            return False
        self.lent = True
        for i in range(len(self._blocks)):
            if i not in self.held:
                self.state[i] = 0
        return True

    def keep_for(self, iterator: Any) -> None:
        """The pool stays lent to persistent workers while their DataLoader iterator lives
        (the iterator shuts them down when it goes)."""
        self._holder = weakref.ref(iterator)

    def give_back(self) -> None:
        """The pass is over and its workers are shut down."""
        self.lent = False
        self._holder = None

    def chunk_array(self, i: int, nbytes: int) -> Any:
        """The first ``nbytes`` of block ``i`` as a uint8 array; the block is free again
        once this array and every view of it are gone."""
        import numpy as np

        arr = np.frombuffer(self._views[i][:nbytes], dtype=np.uint8)
        self.held.add(i)
        self.state[i] = 2
        weakref.finalize(arr, self._release, i)
        return arr

    def _release(self, i: int) -> None:
        if os.getpid() == self._owner:  # not a forked worker collecting an inherited view
            self.held.discard(i)
            self.state[i] = 0

    # -- in a worker ---------------------------------------------------------------------------

    def take(self, worker: int) -> int | None:
        """A free block of worker ``worker`` (now taken), or None."""
        base = worker * self.per_worker
        for i in range(base, base + self.per_worker):
            if self.state[i] == 0:
                self.state[i] = 1
                return i
        return None

    def reclaim(self, worker: int) -> None:
        """At the start of a persistent worker's pass: its blocks taken in the last pass
        and never mapped by the training process are free (state 1 -> 0)."""
        base = worker * self.per_worker
        for i in range(base, base + self.per_worker):
            if self.state[i] == 1:
                self.state[i] = 0

    def block(self, i: int) -> Any:
        return self._blocks[i]


class WireChunk:
    """Consecutive batches of one DataLoader worker on their way to the training process:
    the columns of all of them (numpy arrays, tensors in one shared block, lists, or
    ``(offset, dtype, shape)`` places in pool block ``block``), the batch sizes, and the
    worker's progress before the first one."""

    __slots__ = ("arrays", "sizes", "start", "block", "nbytes", "ipc")

    def __init__(
        self,
        arrays: Any,
        sizes: list[int],
        start: tuple[int, int],
        block: int | None = None,
        nbytes: int = 0,
        ipc: bool = False,
    ):
        self.arrays = arrays  # ipc: record batches (or None: an IPC stream in the block)
        self.sizes = sizes
        self.start = start
        self.block = block
        self.nbytes = nbytes
        self.ipc = ipc

    def __getstate__(self) -> tuple[Any, ...]:
        return self.arrays, self.sizes, self.start, self.block, self.nbytes, self.ipc

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        self.arrays, self.sizes, self.start, self.block, self.nbytes, self.ipc = state

    def _pooled(self, pool: BlockPool | None) -> Any:
        if pool is None:  # cannot happen: a pooled chunk comes from a pool's worker
            raise RuntimeError("TableLoader: a pooled chunk arrived without its pool")
        return pool.chunk_array(self.block, self.nbytes)  # type: ignore[arg-type]

    def _columns(self, pool: BlockPool | None) -> dict[str, Any]:
        import numpy as np
        import torch

        arrays = self.arrays
        if self.block is not None:
            raw = self._pooled(pool)
            arrays = {
                k: raw[v[0] : v[0] + _nbytes(v)].view(v[1]).reshape(v[2])
                if isinstance(v, tuple)
                else v
                for k, v in arrays.items()
            }
        cols = {}
        for k, v in arrays.items():
            if isinstance(v, np.ndarray):
                v = torch.from_numpy(v)
            cols[k] = v
        return cols

    def batches(
        self, pool: BlockPool | None = None
    ) -> Iterator[tuple[dict[str, Any], tuple[int, int]]]:
        """``(batch of tensors, worker progress after it)``, in order (views, no copy);
        for an IPC chunk, ``(record batch, progress)`` (read from the block, no copy)."""
        import warnings

        if self.ipc:
            if self.block is None:
                batches = self.arrays
            else:  # the batches keep the block's array alive: it is freed after the last
                batches = list(pa.ipc.open_stream(pa.py_buffer(self._pooled(pool))))
            yield from zip(batches, self._progress(), strict=True)
            return
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only buffers
            cols = self._columns(pool)
        off = 0
        for size, done in zip(self.sizes, self._progress(), strict=True):
            yield {k: v[off : off + size] for k, v in cols.items()}, done
            off += size

    def _progress(self) -> Iterator[tuple[int, int]]:
        """The worker's progress after each batch of the chunk."""
        nb, nr = self.start
        for size in self.sizes:
            nb, nr = nb + 1, nr + size
            yield nb, nr


def _nbytes(place: tuple[int, str, tuple[int, ...]]) -> int:
    import numpy as np

    n = np.dtype(place[1]).itemsize
    for d in place[2]:
        n *= d
    return n


def _plain(col: pa.ChunkedArray) -> Any:
    """``(dtype, row shape)`` when every chunk of ``col`` is a zero-copy numpy view of one
    dtype (integers, floats, fixed-size lists of them, no nulls), else None."""
    import numpy as np

    t = col.type
    if col.null_count:
        return None
    if pa.types.is_integer(t) or pa.types.is_floating(t):
        return np.dtype(t.to_pandas_dtype()), ()
    if pa.types.is_fixed_size_list(t) and (
        pa.types.is_integer(t.value_type) or pa.types.is_floating(t.value_type)
    ):
        if any(c.flatten().null_count for c in col.chunks):
            return None
        return np.dtype(t.value_type.to_pandas_dtype()), (t.list_size,)
    return None


def to_wire(
    group: Sequence[pa.Table],
    start: tuple[int, int],
    pool: BlockPool | None = None,
    worker: int = 0,
) -> WireChunk:
    """A worker's chunk of the batches ``group`` (Arrow tables, one per batch) for
    ``output="torch"``: in a block of ``pool`` when one is free and big enough (copied
    there straight from Arrow's buffers), else plain arrays for a small chunk and tensors in
    one fresh shared memory segment for a large one."""
    import numpy as np

    sizes = [t.num_rows for t in group]
    rows = sum(sizes)
    names = group[0].schema.names
    cols = {n: pa.chunked_array([c for t in group for c in t.column(n).chunks]) for n in names}
    plain = {n: _plain(c) for n, c in cols.items()}
    need = sum(
        _aligned(rows * int(np.prod(p[1], dtype=np.int64)) * p[0].itemsize)
        for p in plain.values()
        if p is not None
    )
    block = pool.take(worker) if pool is not None and 0 < need <= pool.block_bytes else None
    if block is None:
        arrays = {n: column_array(c) for n, c in cols.items()}
        size = sum(a.nbytes for a in arrays.values() if not isinstance(a, list))
        if size >= PIPE_BYTES:
            arrays = as_tensors(arrays, pack=True)
        return WireChunk(arrays, sizes, start)
    assert pool is not None
    raw = pool.block(block)
    out: dict[str, Any] = {}
    off = 0
    for n, c in cols.items():
        p = plain[n]
        if p is None:
            out[n] = column_array(c)
            continue
        dtype, shape = p
        width = int(np.prod(shape, dtype=np.int64))
        nbytes = rows * width * dtype.itemsize
        dest = raw[off : off + nbytes].view(dtype)
        at = 0
        for chunk in c.chunks:
            src = chunk.flatten() if shape else chunk
            k = len(src)
            dest[at : at + k] = src.to_numpy(zero_copy_only=True)
            at += k
        out[n] = (off, dtype.str, (rows, *shape))
        off += _aligned(nbytes)
    return WireChunk(out, sizes, start, block, off)


def to_wire_ipc(
    group: Sequence[pa.Table],
    start: tuple[int, int],
    pool: BlockPool | None = None,
    worker: int = 0,
) -> WireChunk:
    """A worker's chunk of the batches ``group`` for ``output="arrow"``: their Arrow IPC
    stream written into a free block of ``pool``, else (no block free, too big) the record
    batches themselves, pickled through the DataLoader's pipe."""
    from .convert import as_record_batch, compact

    batches = [as_record_batch(t) for t in group]
    sizes = [b.num_rows for b in batches]
    block = pool.take(worker) if pool is not None else None
    if block is not None:
        assert pool is not None
        sink = pa.FixedSizeBufferWriter(pa.py_buffer(pool.block(block)))
        try:
            with pa.ipc.new_stream(sink, batches[0].schema) as writer:
                for b in batches:
                    writer.write_batch(b)
            return WireChunk(None, sizes, start, block, sink.tell(), ipc=True)
        except (pa.ArrowException, OSError, ValueError):  # bigger than a block
            pool.state[block] = 0
    return WireChunk([compact(b) for b in batches], sizes, start, ipc=True)


__all__ = [
    "BlockPool",
    "CHUNK_BATCHES",
    "CHUNK_BYTES",
    "PIPE_BYTES",
    "WireChunk",
    "to_wire",
    "to_wire_ipc",
]
