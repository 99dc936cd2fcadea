"""TableDataset in one process: the split arithmetic, Parquet and Delta reads, errors, resume.

Ranks are simulated with ``rank=``/``world_size=``; ``memory://`` stands in for remote storage
(it goes through the node cache like s3 does). The real 2-rank runs, on local disk and on a
loopback S3 server, are in tests/system/test_tables.py.
"""

from __future__ import annotations

import collections
import datetime
import os
import random
import uuid

import pytest

import tablewriters as tw
from conftest import run_python
from gangrun.data import TableDataset, TableError, split
from gangrun.data.table import plan

pa = pytest.importorskip("pyarrow")
pc = pytest.importorskip("pyarrow.compute")
pq = pytest.importorskip("pyarrow.parquet")


# -- the split arithmetic (pure) ------------------------------------------------------------


def _positions(order, rows, pieces):
    """Epoch positions of pieces, as (unit, row) pairs."""
    return [(p.unit, p.start + k) for p in pieces for k in range(p.length)]


@pytest.mark.parametrize("trial", range(60))
def test_split_is_exact_and_equal_per_rank(trial):
    rnd = random.Random(trial)
    rows = [rnd.randint(1, 40) for _ in range(rnd.randint(1, 12))]
    world, nw, bs = rnd.randint(1, 4), rnd.randint(1, 4), rnd.randint(1, 9)
    uneven, drop_last = rnd.choice(["pad", "drop"]), rnd.random() < 0.3
    order = plan.unit_order(len(rows), True, trial, 1)
    total = sum(rows)
    seen: list[tuple[int, int]] = []
    shapes = []
    for r in range(world):
        lay = plan.rank_layout(total, r, world, bs, uneven, drop_last)
        sizes = []
        for w in range(nw):
            pos, n = plan.worker_range(lay, w, nw, bs)
            got = _positions(order, rows, plan.pieces(order, rows, pos, n))
            assert len(got) == n
            seen += got
            nb = plan.worker_batches(lay, w, nw)
            assert nb == -(-n // bs)  # whole batches, at most the last one short
            sizes.append([min(bs, n - k * bs) for k in range(nb)])
        shapes.append(sizes)
    assert all(s == shapes[0] for s in shapes)  # same batches, same sizes, on every rank
    counts = collections.Counter(seen)
    assert all(0 <= u < len(rows) and 0 <= k < rows[u] for u, k in counts)
    per = -(-total // world) if uneven == "pad" else total // world
    if not drop_last:
        if uneven == "pad":  # none skipped, fewer than `world` read twice
            assert len(counts) == total and max(counts.values()) <= 2
            assert len(seen) - total == per * world - total < world
        else:  # none read twice, the last total % world of the epoch skipped
            assert max(counts.values(), default=1) == 1 and len(seen) == total - total % world
    assert len(seen) <= per * world


def test_pieces_follow_the_epoch_order():
    rows = [3, 5, 2]
    order = [2, 0, 1]
    assert plan.pieces(order, rows, 0, 10) == [(2, 0, 2), (0, 0, 3), (1, 0, 5)]
    assert plan.pieces(order, rows, 4, 3) == [(0, 2, 1), (1, 0, 2)]
    assert plan.pieces(order, rows, 9, 3) == [(1, 4, 1), (2, 0, 2)]  # wraps: padding


def test_shuffle_blocks_resume_arithmetic():
    assert plan.blocks(0, 10, 4) == [(0, 0, 4, 0), (1, 4, 4, 0), (2, 8, 2, 0)]
    assert plan.blocks(5, 10, 4) == [(1, 4, 4, 1), (2, 8, 2, 0)]
    assert plan.blocks(10, 10, 4) == []
    assert plan.block_seed(1, 2, 3, 4) == plan.block_seed(1, 2, 3, 4)
    assert plan.block_seed(1, 2, 3, 4) != plan.block_seed(1, 3, 3, 4)


def test_rank_without_world_size_is_an_error(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="RANK is set .* WORLD_SIZE is not"):
        split.rank_world()
    monkeypatch.delenv("RANK")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="WORLD_SIZE is set .* RANK is not"):
        split.rank_world()
    monkeypatch.setenv("RANK", "1")
    assert split.rank_world() == (1, 2)
    assert split.rank_world(0, 1) == (0, 1)
    with pytest.raises(ValueError, match="outside"):
        split.rank_world(2, 2)


# -- Parquet --------------------------------------------------------------------------------


@pytest.fixture(params=["local", "memory"])
def parquet(request, tmp_path):
    root = str(tmp_path / "pq") if request.param == "local" else f"memory://{uuid.uuid4().hex}"
    ids = tw.write_parquet(root)
    yield root, ids
    if request.param == "memory":
        import fsspec

        fsspec.filesystem("memory").rm(root.replace("memory://", "/"), recursive=True)


def _ids(batches):
    return [i for b in batches for i in b["id"].tolist()]


def _ranks(root, tmp_path, world=2, epoch=0, **kw):
    out = []
    for r in range(world):
        ds = TableDataset(root, rank=r, world_size=world, cache_dir=str(tmp_path / "c"), **kw)
        ds.set_epoch(epoch)
        batches = list(ds)
        assert len(batches) == len(ds)
        out.append(batches)
    return out


@pytest.mark.parametrize("uneven", ["pad", "drop"])
def test_parquet_every_row_once_equal_batches(parquet, tmp_path, uneven):
    root, ids = parquet
    per_rank = _ranks(root, tmp_path, shuffle=True, seed=4, batch_size=64, uneven=uneven)
    assert [len(b) for b in per_rank[0]] == [len(b) for b in per_rank[1]]
    assert [len(b["id"]) for b in per_rank[0]] == [len(b["id"]) for b in per_rank[1]]
    counts = collections.Counter(_ids(per_rank[0]) + _ids(per_rank[1]))
    if uneven == "pad":  # 3001 rows: one is read twice, none skipped
        assert set(counts) == ids and sum(counts.values()) == len(ids) + 1
    else:
        assert set(counts) <= ids and len(counts) == len(ids) - 1 == sum(counts.values())
    first = per_rank[0][0]
    assert first["x"].dtype.is_floating_point and first["emb"].shape == (64, 4)
    assert isinstance(first["label"], list) and first["label"][0] == f"r{first['id'][0]}"
    assert (first["emb"][:, 0] == first["id"].float()).all()


def test_parquet_shuffle_per_epoch_reproducible(parquet, tmp_path):
    root, ids = parquet
    kw = dict(shuffle=True, seed=9, batch_size=100, shuffle_buffer=500)
    e0 = [_ids(b) for b in _ranks(root, tmp_path, epoch=0, **kw)]
    e0b = [_ids(b) for b in _ranks(root, tmp_path, epoch=0, **kw)]
    e1 = [_ids(b) for b in _ranks(root, tmp_path, epoch=1, **kw)]
    assert e0 == e0b  # same seed and epoch: same order
    assert e0 != e1 and set(e0[0] + e0[1]) == set(e1[0] + e1[1]) == ids
    unshuffled = _ids(_ranks(root, tmp_path, world=1, batch_size=100)[0])
    assert unshuffled == sorted(ids)  # files in sorted order, rows in file order
    assert e0[0] != sorted(e0[0])  # rows mixed inside the shuffle buffer too


def test_parquet_columns_filter_and_outputs(parquet, tmp_path):
    root, _ = parquet
    seen = []

    def transform(batch):
        seen.append(type(batch))
        return batch

    ds = TableDataset(
        root,
        columns=["id", "label"],
        filter=(pc.bit_wise_and(pc.field("id"), 1) == 0) & (pc.field("x") < 1000),
        batch_size=50,
        output="arrow",
        transform=transform,
    )
    got = list(ds)
    assert all(isinstance(b, pa.RecordBatch) and b.schema.names == ["id", "label"] for b in got)
    ids = [i for b in got for i in b.column("id").to_pylist()]
    assert ids == [i for i in range(2000) if i % 2 == 0] and ds.rows == len(ids)
    assert seen == [pa.RecordBatch] * len(got)
    dnf = TableDataset(root, columns=["id"], filter=[("id", "<", 10)], output="pandas")
    (frame,) = list(dnf)
    assert list(frame["id"]) == list(range(10))
    (arrays,) = list(TableDataset(root, columns=["x"], filter=[("id", "<", 5)], output="numpy"))
    assert arrays["x"].tolist() == [0.0, 0.5, 1.0, 1.5, 2.0]


def test_torch_batches_are_zero_copy(tmp_path):
    from gangrun.data.table.convert import to_torch

    batch = pa.record_batch(
        {
            "i": pa.array([1, 2, 3], pa.int64()),
            "ts": pa.array([1, 2, 3], pa.timestamp("us")),
            "v": pa.array([[1.0, 2.0]] * 3, pa.list_(pa.float32(), 2)),
            "n": pa.array([1, None, 3], pa.int32()),
            "b": pa.array([True, False, True]),
        }
    )
    out = to_torch(batch)
    assert out["i"].data_ptr() == batch.column("i").buffers()[1].address
    assert out["ts"].tolist() == [1, 2, 3] and out["v"].shape == (3, 2)
    assert out["n"].isnan().tolist() == [False, True, False]  # nulls: NaN
    assert out["b"].tolist() == [True, False, True]


def test_resume_mid_epoch_direct(parquet, tmp_path):
    root, _ = parquet
    kw = dict(shuffle=True, seed=2, batch_size=64, shuffle_buffer=300, rank=1, world_size=2)
    full = _ids(TableDataset(root, **kw))
    ds = TableDataset(root, **kw)
    it = iter(ds)
    head = _ids([next(it) for _ in range(7)])
    state = ds.state_dict()
    del it
    again = TableDataset(root, **kw)
    again.load_state_dict(state)
    rest = _ids(again)
    assert head + rest == full  # exactly the rows not yet seen, in the same order


@pytest.mark.parametrize("num_workers", [2, 3])
def test_resume_mid_epoch_loader(tmp_path, num_workers):
    root = str(tmp_path / "pq")
    tw.write_parquet(root)
    kw = dict(shuffle=True, seed=5, batch_size=50, rank=0, world_size=2)
    ds = TableDataset(root, **kw)
    full = sorted(_ids(ds.loader(num_workers=num_workers)))
    assert len(full) == 1501
    ds = TableDataset(root, **kw)
    head = []
    for n, b in enumerate(ds.loader(num_workers=num_workers), 1):
        head += b["id"].tolist()
        if n == 11:
            break
    state = ds.state_dict()
    again = TableDataset(root, **kw)
    again.load_state_dict(state)
    rest = _ids(again.loader(num_workers=num_workers))
    assert sorted(head + rest) == full and not set(head) & set(rest)


def test_remote_files_go_through_the_cache(tmp_path):
    root = f"memory://{uuid.uuid4().hex}"
    tw.write_parquet(root)
    cache = tmp_path / "cache"
    ds = TableDataset(root, cache_dir=str(cache), batch_size=500)
    assert len(_ids(ds)) == tw.PARQUET_ROWS
    assert len(os.listdir(cache / "data")) == len(tw.PARQUET_FILES)
    uncached = TableDataset(root, cache=False, batch_size=500)
    assert len(_ids(uncached)) == tw.PARQUET_ROWS


# -- Delta ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def delta(tmp_path_factory):
    uri = str(tmp_path_factory.mktemp("delta") / "t")
    ids0, ids1 = tw.write_delta(uri)
    return uri, ids0, ids1


def test_delta_versions_and_added_column(delta, tmp_path):
    uri, ids0, ids1 = delta
    latest = TableDataset(uri, batch_size=4000, output="arrow")
    assert latest.table.version == 1 and latest.rows == len(ids1)
    (batch,) = list(latest)
    rows = {r["id"]: r for r in batch.to_pylist()}
    assert set(rows) == ids1
    assert rows[5]["extra"] is None and rows[tw.DELTA_V0 + 3]["extra"] == (tw.DELTA_V0 + 3) % 7
    assert rows[4]["part"] == ["a", "b", "c"][4 % 3]  # partition values from the log
    v0 = TableDataset(uri, version=0, batch_size=100)
    assert v0.rows == len(ids0) and set(_ids(v0)) == ids0 and "extra" not in v0.columns
    with pytest.raises(TableError, match="no version 7"):
        TableDataset(uri, version=7)
    stamp = datetime.datetime.now(datetime.timezone.utc)
    assert TableDataset(uri, timestamp=stamp).rows == len(ids1)
    with pytest.raises(TableError, match="has no version at or before .*first commit is after"):
        TableDataset(uri, timestamp=datetime.datetime(2000, 1, 1))
    per_rank = _ranks(
        uri, tmp_path, shuffle=True, seed=1, batch_size=128, filter=[("part", "=", "a")]
    )
    got = _ids(per_rank[0]) + _ids(per_rank[1])
    want = {i for i in ids0 if i % 3 == 0} | (ids1 - ids0)
    assert set(got) == want and len(got) - len(want) <= 1


def test_delta_timestamp_selects_the_version_current_then(tmp_path):
    """A time between two commits selects the older one, as deltalake's own load-as-of does
    (a guard reading the newest commit's time would refuse every earlier time, "first
    commit is after"); a time before the first commit is refused."""
    import time

    from deltalake import DeltaTable, write_deltalake

    uri = str(tmp_path / "t")
    first = datetime.datetime.now(datetime.timezone.utc)
    stamps = []
    for k in range(4):  # 4 commits, 100 rows each, a time between each pair (and after)
        time.sleep(0.05)  # commit times are in ms (file times: a few ms coarse)
        write_deltalake(uri, pa.table({"id": list(range(100 * k, 100 * k + 100))}), mode="append")
        time.sleep(0.05)
        stamps.append(datetime.datetime.now(datetime.timezone.utc))
    for k, stamp in enumerate(stamps):
        ref = DeltaTable(uri)
        ref.load_as_version(stamp)
        want = set(ref.to_pyarrow_table().column("id").to_pylist())
        for t in (stamp, stamp.isoformat(), stamp.replace(tzinfo=None)):  # naive: UTC
            ds = TableDataset(uri, timestamp=t, batch_size=1000)
            assert ds.table.version == ref.version() == k, (k, t)
            assert set(_ids(ds)) == want == set(range(100 * (k + 1)))
    with pytest.raises(TableError, match="has no version at or before .*first commit is after"):
        TableDataset(uri, timestamp=first)


def test_delta_is_read_from_its_log_not_the_directory(delta, tmp_path):
    uri, _, ids1 = delta
    import shutil

    copy = str(tmp_path / "copy")
    shutil.copytree(uri, copy)
    pq.write_table(pa.table({"id": [10**6]}), os.path.join(copy, "stray.parquet"))
    assert set(_ids(TableDataset(copy, batch_size=5000))) == ids1  # stray file not read
    with pytest.raises(TableError, match="is a Delta table"):
        TableDataset(copy, format="parquet")


def test_delta_refuses_what_it_cannot_read():
    from gangrun.data.table.delta import check_protocol, delta_storage_options

    check_protocol("t", 1, None, {}, 0)
    check_protocol("t", 3, ["deletionVectors", "timestampNtz"], {}, 0)
    with pytest.raises(TableError, match="deletion vectors on 2 file"):
        check_protocol("t", 3, ["deletionVectors"], {}, 2)
    with pytest.raises(TableError, match="column mapping"):
        check_protocol("t", 2, None, {"delta.columnMapping.mode": "name"}, 0)
    with pytest.raises(TableError, match="typeWidening"):
        check_protocol("t", 3, ["typeWidening"], {}, 0)
    with pytest.raises(TableError, match="reader version 4"):
        check_protocol("t", 4, None, {}, 0)
    opts = delta_storage_options("s3", {"endpoint_url": "http://h:1", "key": "k", "secret": "s"})
    assert opts == {
        "AWS_ENDPOINT_URL": "http://h:1",
        "AWS_ALLOW_HTTP": "true",
        "AWS_ACCESS_KEY_ID": "k",
        "AWS_SECRET_ACCESS_KEY": "s",
    }


# -- errors ---------------------------------------------------------------------------------


def test_clear_errors(tmp_path):
    root = str(tmp_path / "pq")
    tw.write_parquet(root)
    with pytest.raises(TableError, match="column\\(s\\) 'nope' not in"):
        TableDataset(root, columns=["id", "nope"])
    with pytest.raises(TableError, match="no rows that pass the filter"):
        TableDataset(root, filter=pc.field("id") < 0)
    with pytest.raises(TableError, match="filter .* cannot be applied"):
        TableDataset(root, filter=pc.field("missing") < 0)
    other = tmp_path / "mixed"
    other.mkdir()
    pq.write_table(pa.table({"id": pa.array([1], pa.int64())}), other / "a.parquet")
    pq.write_table(pa.table({"id": pa.array([1.5])}), other / "b.parquet")
    with pytest.raises(TableError, match="do not share one schema: column 'id' is double"):
        TableDataset(str(other))
    (tmp_path / "empty").mkdir()
    with pytest.raises(TableError, match="holds no Parquet files"):
        TableDataset(str(tmp_path / "empty"))
    pq.write_table(pa.table({"id": pa.array([], pa.int64())}), tmp_path / "empty" / "e.parquet")
    with pytest.raises(TableError, match="has no rows"):
        TableDataset(str(tmp_path / "empty"))
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("hello")
    with pytest.raises(TableError, match="not a readable Parquet file"):
        TableDataset(str(tmp_path / "junk"))
    with pytest.raises(TableError, match="nothing found"):
        TableDataset(str(tmp_path / "absent"))
    with pytest.raises(TableError, match="is not a Delta table"):
        TableDataset(root, format="delta")
    with pytest.raises(TableError, match="need a Delta table"):
        TableDataset(root, version=1)
    with pytest.raises(ValueError, match="batch_size"):
        TableDataset(root).loader(batch_size=4)


def test_import_gangrun_data_imports_no_arrow():
    code = (
        "import sys, gangrun, gangrun.data, gangrun.data.table.plan\n"
        "bad = [m for m in ('pyarrow', 'deltalake', 'torch') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    run_python(code, check=True)


def test_cache_get_file_streams_to_disk_once_and_refills_after_eviction(tmp_path):
    from gangrun.data import FileCache
    from gangrun.data.listing import FileEntry
    from gangrun.data.table.source import FileAccess

    cache = FileCache(tmp_path / "c", limit=10**6)
    calls = []

    def write(tmp):
        calls.append(tmp)
        with open(tmp, "wb") as f:
            f.write(b"x" * 100)

    path = cache.get_file("k", write)
    assert cache.get_file("k", write) == path and len(calls) == 1
    assert os.path.getsize(path) == 100 and cache.stats()["bytes"] == 100
    assert not [n for n in os.listdir(tmp_path / "c" / "data") if ".tmp-" in n]
    # A cached copy evicted between the fill and the open is fetched again.
    root = f"memory://{uuid.uuid4().hex}"
    tw.write_parquet(root)
    access = FileAccess("memory", {}, True, str(tmp_path / "c2"), None)
    import fsspec

    info = fsspec.filesystem("memory").info(root.replace("memory://", "/") + "/part-001.parquet")
    entry = FileEntry(info["name"], int(info["size"]), "v")
    local = access.fetch(entry)
    os.unlink(local)
    src, fs = access.open(entry, local)
    assert fs is None and pq.read_metadata(src).num_rows == 700


def _collate_tensors(batch):
    import torch

    assert isinstance(batch["id"], torch.Tensor), type(batch)  # not the workers' hand-over
    return batch


def test_loader_collate_fn_and_pin_memory_see_tensor_batches(tmp_path):
    root = str(tmp_path / "pq")
    tw.write_parquet(root)
    ds = TableDataset(root, columns=["id"], batch_size=1000)
    got = _ids(ds.loader(num_workers=2, collate_fn=_collate_tensors))  # runs in the workers
    assert sorted(got) == list(range(tw.PARQUET_ROWS))
    assert sorted(_ids(ds.loader(num_workers=2, pin_memory=True))) == sorted(got)
