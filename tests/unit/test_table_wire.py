"""TableLoader's worker hand-over (`gangrun.data.table.handover`): batches travel through the
dataset's shared memory blocks, a block is never rewritten while the training loop holds a
batch that lives in it, and every fallback (pool exhausted, pool held by another pass,
pickled pool) still delivers every row intact."""

from __future__ import annotations

import pickle

import pytest

import tablewriters as tw
from gangrun.data import TableDataset

torch = pytest.importorskip("torch")
pytest.importorskip("pyarrow")


def _check(batch) -> None:
    """The batch's columns are the rows of its ids (tablewriters: x = id / 2, emb = [id] * 4)."""
    ids = batch["id"]
    assert torch.equal(batch["x"], ids.to(torch.float32) * 0.5)
    assert torch.equal(batch["emb"], ids.to(torch.float32)[:, None].expand(-1, 4))
    assert batch["label"] == [f"r{i}" for i in ids.tolist()]


def _pooled(ds: TableDataset, batch) -> bool:
    """Whether the batch's ids live in one of the dataset's pool blocks."""
    return tw.in_pool(ds, batch["id"].data_ptr())


@pytest.fixture
def root(tmp_path):
    path = str(tmp_path / "pq")
    tw.write_parquet(path)
    return path


def test_batches_travel_in_pool_blocks_kept_across_epochs(root):
    ds = TableDataset(root, batch_size=50, shuffle=True, seed=1)
    pools = []
    for epoch in range(2):
        ds.set_epoch(epoch)
        ids, pooled, n = [], 0, 0
        for batch in ds.loader(num_workers=2):
            _check(batch)
            ids += batch["id"].tolist()
            pooled += _pooled(ds, batch)
            n += 1
        assert sorted(ids) == list(range(tw.PARQUET_ROWS))
        assert pooled == n  # every batch dropped before the next: blocks are always free
        del batch  # the last one lives in a block until dropped
        assert ds.pool is not None and not ds.pool.held and not ds.pool.busy
        pools.append(ds.pool)
    assert pools[0] is pools[1]  # made once, kept by the dataset


def test_held_batches_are_never_overwritten(root):
    """The training loop keeps every batch: the blocks run out, later chunks take the
    fallbacks, and no held batch changes."""
    ds = TableDataset(root, batch_size=10)
    batches = list(ds.loader(num_workers=2))
    pooled = [_pooled(ds, b) for b in batches]
    assert any(pooled) and not all(pooled)  # both paths were taken
    for b in batches:
        _check(b)
    assert sorted(i for b in batches for i in b["id"].tolist()) == list(range(tw.PARQUET_ROWS))
    assert ds.pool is not None and ds.pool.held
    del b, batches
    assert not ds.pool.held  # the last view gone: the blocks are free again


def test_a_pass_left_midway_frees_its_blocks(root):
    ds = TableDataset(root, batch_size=10)
    for n, _ in enumerate(ds.loader(num_workers=2)):
        if n == 5:
            break  # the workers had taken blocks for chunks never delivered
    ids, pooled = [], 0
    for batch in ds.loader(num_workers=2):
        _check(batch)
        ids += batch["id"].tolist()
        pooled += _pooled(ds, batch)
    assert sorted(ids) == list(range(tw.PARQUET_ROWS))
    assert pooled == len(ids) // 10 + (len(ids) % 10 > 0)


def test_two_passes_at_once_do_not_share_blocks(root):
    ds = TableDataset(root, batch_size=100)
    first = iter(ds.loader(num_workers=2))
    head = next(first)
    assert _pooled(ds, head)
    other = TableDataset(root, batch_size=100)
    other.pool = ds.pool  # the same blocks, lent to the first pass
    second = list(other.loader(num_workers=2))
    assert not any(_pooled(other, b) for b in second)  # the second pass used the fallbacks
    ids = [i for b in second for i in b["id"].tolist()]
    assert sorted(ids) == list(range(tw.PARQUET_ROWS))
    rest = list(first)
    for b in [head, *rest, *second]:
        _check(b)
    assert sorted(i for b in [head, *rest] for i in b["id"].tolist()) == sorted(ids)


def test_a_pickled_pool_is_none_and_workers_fall_back(root):
    from gangrun.data.table.handover import BlockPool

    assert pickle.loads(pickle.dumps(BlockPool(1, 1, 4096))) is None
    ds = TableDataset(root, batch_size=100)
    ds2 = pickle.loads(pickle.dumps(ds))
    assert ds2.pool is None and ds2.pool_active is None


def test_direct_row_group_reads_equal_dataset_reads(root):
    """Plain local Parquet is read with ``ParquetFile.read_row_group`` (less CPU per row);
    the rows, column order and schema are those of the dataset read a filter forces."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from gangrun.data.table import plan
    from gangrun.data.table.source import Reader

    def read(ds):
        todo = plan.pieces(ds.unit_order(), ds._unit_rows, 0, ds.rows)
        reader = Reader(ds, todo, False)
        out = pa.concat_tables([reader.read(p) for p in todo])
        return out, reader._direct is not None

    cols = ["emb", "id", "label"]  # not the files' order
    direct, used = read(TableDataset(root, columns=cols))
    scanned, used_with_filter = read(TableDataset(root, columns=cols, filter=pc.field("id") >= 0))
    assert used and not used_with_filter
    assert direct.column_names == cols and direct.equals(scanned)
    assert direct.schema == scanned.schema


def test_arrow_batches_travel_as_ipc_streams_in_pool_blocks(root):
    """``output="arrow"``: a chunk is its batches' Arrow IPC stream written into a block;
    the record batches the loop gets are read from the block without a copy, strings and
    fixed-size lists included, and the block is free once they are gone."""
    import pyarrow as pa

    ds = TableDataset(root, batch_size=50, output="arrow", shuffle=True, seed=2)
    ids, pooled, n = [], 0, 0
    for batch in ds.loader(num_workers=2):
        assert isinstance(batch, pa.RecordBatch)
        _check({k: _as_torch(batch.column(k)) for k in batch.schema.names})
        ids += batch.column("id").to_pylist()
        pooled += tw.in_pool(ds, batch.column("id").buffers()[1].address)
        n += 1
    assert sorted(ids) == list(range(tw.PARQUET_ROWS))
    assert pooled == n
    del batch
    assert not ds.pool.held


def test_an_arrow_chunk_bigger_than_a_block_travels_pickled(root):
    import pyarrow as pa

    from gangrun.data.table.handover import BlockPool, to_wire_ipc

    table = pa.table({"id": pa.array(range(1000)), "s": pa.array([f"r{i}" for i in range(1000)])})
    pool = BlockPool(1, 1, block_bytes=4096)
    chunk = to_wire_ipc([table.slice(0, 500), table.slice(500)], (0, 0), pool, 0)
    assert chunk.block is None and pool.state[0] == 0  # the block was given back
    got = list(chunk.batches(pool))
    assert [b.num_rows for b, _ in got] == [500, 500] and got[-1][1] == (2, 1000)
    assert pa.Table.from_batches([b for b, _ in got]).equals(table)


def _as_torch(col):
    from gangrun.data.table.convert import column_to_torch

    return column_to_torch(col)
