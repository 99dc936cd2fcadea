"""`TableLoader`: the DataLoader of [`TableDataset.loader`][gangrun.data.TableDataset.loader].

Its workers hand batches over in chunks of several (`table.handover`); the loader hands them
to the training loop one batch at a time, round-robin over the workers, recording each
worker's progress as it goes, so `TableDataset.state_dict()` is exact at any batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader

from ..loader import VolumeLoader
from ..split import Position
from . import held, plan
from .handover import BlockPool, WireChunk


def identity(x: Any) -> Any:
    """The loader's default ``collate_fn``: batches are made by the dataset."""
    return x


class _WireView:
    """The dataset as `TableLoader`'s workers see it: batches travel in chunks
    (``output="torch"``: plain arrays, ``"arrow"``: an Arrow IPC stream; see `table.handover`)."""

    def __init__(self, ds: Any) -> None:
        self.ds = ds

    def resume_position(self) -> Position | None:
        return self.ds.resume_position()

    @property
    def epoch(self) -> int:
        return self.ds.epoch

    def set_epoch(self, epoch: int) -> None:
        self.ds.set_epoch(epoch)

    def start_progress(self, num_workers: int, start: Position | None = None) -> None:
        self.ds.start_progress(num_workers, start)

    def iter_tagged(self, start: Position | None = None) -> Iterator[Any]:
        return self.ds.iter_wire(start)

    def record_progress(self, worker: int, progress: Any) -> None:
        self.ds.record_progress(worker, progress)

    @property
    def seed(self) -> int:
        return self.ds.seed

    @property
    def held(self) -> dict[str, int] | None:
        return self.ds.held

    def rank_world(self) -> tuple[int, int]:
        return self.ds.rank_world()

    def lane_layout(self) -> Any:
        return self.ds.lane_layout()

    def state_dict(self) -> dict[str, Any]:
        return self.ds.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ds.load_state_dict(state)


class TableLoader(VolumeLoader):
    """The loader of `TableDataset.loader`: a `VolumeLoader` whose
    workers hand batches over in chunks of several (``output="torch"`` or ``"arrow"``
    without a ``transform``; see `table.handover`): the hand-over costs about the same per item whatever
    its size, and the columns travel through shared memory blocks the dataset keeps. Each
    batch of a chunk is handed to the training loop, and its progress recorded, in turn."""

    def __init__(self, dataset: Any, **kwargs: Any) -> None:
        self.table = dataset
        self._wire = (
            dataset.output in ("torch", "arrow")
            and dataset.transform is None
            and kwargs.get("collate_fn") in (None, identity)  # a collate_fn sees batches
            and not kwargs.get("pin_memory")  # pinned: the DataLoader pins tensors
        )
        view: Any = _WireView(dataset) if self._wire else dataset
        super().__init__(view, **kwargs)
        self._started = False  # persistent workers: the first pass started them
        self._kept_pool: BlockPool | None = None  # ... and the blocks lent to them

    def _lend_pool(self) -> BlockPool | None:
        """The dataset's blocks for this pass (made on first use), or None (another pass
        holds them, or no shared memory: the workers use the fallbacks)."""
        ds = self.table
        nw, per = int(self.num_workers), int(self.prefetch_factor or 2) + 2
        pool = ds.pool
        if pool is None or pool.workers < nw or pool.per_worker < per:
            if pool is not None and pool.busy:
                return None
            try:
                pool = ds.pool = BlockPool(nw, per)
            except (RuntimeError, OSError):
                return None
        return pool if pool.lend() else None

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        self._begin_pass()
        if self._channel is not None:  # persistent workers: started by the first pass
            if not self._started:
                self._kept_pool = self._lend_pool() if self._wire else None
            yield from self._deliver(self._start_pass(self._kept_pool), self._kept_pool)
            return
        pool = self._lend_pool() if self._wire and self.num_workers > 0 else None
        it = self._start_pass(pool)
        try:
            yield from self._deliver(it, pool)
        finally:
            if pool is not None:
                shutdown = getattr(it, "_shutdown_workers", None)
                if shutdown is not None:
                    shutdown()  # no worker of this pass writes into a block any more
                pool.give_back()

    def _start_pass(self, pool: BlockPool | None) -> Any:
        """The DataLoader's iterator of this pass (workers forked now inherit ``pool``)."""
        self.table.pool_active = pool
        try:
            it = DataLoader.__iter__(self)
        finally:
            self.table.pool_active = None
        if pool is not None and self._channel is not None and not self._started:
            pool.keep_for(it)  # lent while these persistent workers live
        self._started = True
        return it

    def _deliver(self, it: Any, pool: BlockPool | None) -> Iterator[Any]:
        """Each batch of the pass, its worker's progress recorded as it is handed out."""
        ds = self.volume
        if self._held is not None:  # the global batch held: a part of each worker, joined
            yield from held.turns(self, it, pool)
            return
        if self._wire and int(self.num_workers) > 1:
            yield from self._in_turn(it, pool)
            return
        for item, (wid, progress) in it:
            if isinstance(item, WireChunk):
                for batch, done in item.batches(pool):
                    ds.record_progress(wid, done)
                    yield batch
            else:
                ds.record_progress(wid, progress)
                yield item

    def _in_turn(self, it: Any, pool: BlockPool | None) -> Iterator[Any]:
        """The batches of the workers' chunks one at a time, round-robin over the workers
        (skipping those that are done), from the worker the position names next.

        Chunks group a varying number of batches (fewer at the start of a pass), so the
        DataLoader's round-robin over chunks depends on where the pass started: a resumed
        pass would interleave the workers otherwise than the interrupted one. Taking one
        batch of each worker in turn gives one order whatever the chunking, so a pass
        resumed at any batch continues exactly (each worker's batch count is known)."""
        from collections import deque

        ds = self.table
        nw = int(self.num_workers)
        live = ds.position() or {}
        layout = ds.layout()
        done = [(w or [0])[0] for w in live.get("workers") or [None] * nw]
        left = [plan.worker_batches(layout, w, nw) - int(done[w]) for w in range(nw)]
        queued: list[deque[Iterator[Any]]] = [deque() for _ in range(nw)]
        cur = int(live.get("next") or 0) % nw
        while any(n > 0 for n in left):
            while left[cur] <= 0:
                cur = (cur + 1) % nw
            got = None
            while got is None:
                q = queued[cur]
                if q:
                    got = next(q[0], None)
                    if got is None:
                        q.popleft()
                    continue
                try:
                    item, (wid, progress) = next(it)
                except StopIteration:
                    left = [0] * nw  # fewer batches than planned: hand out what is queued
                    break
                q = queued[wid]
                if isinstance(item, WireChunk):
                    q.append(iter(item.batches(pool)))
                else:
                    q.append(iter([(item, progress)]))
            if got is None:
                break
            batch, progress = got
            ds.record_progress(cur, progress)
            left[cur] -= 1
            yield batch
            cur = (cur + 1) % nw
        for w in range(nw):  # normally empty: the planned counts were right
            for chunk in queued[w]:
                for batch, progress in chunk:
                    ds.record_progress(w, progress)
                    yield batch
        for item, (wid, progress) in it:  # ends the DataLoader's pass (normally nothing)
            chunks = item.batches(pool) if isinstance(item, WireChunk) else [(item, progress)]
            for batch, done_now in chunks:
                ds.record_progress(wid, done_now)
                yield batch


__all__ = ["TableLoader", "identity"]
