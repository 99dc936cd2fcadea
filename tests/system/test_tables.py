"""TableDataset across 2 real ranks (gangrun calls) x 0/2/3 DataLoader workers, over tables
written by pyarrow and by deltalake, on local disk and on a loopback S3 server (moto)."""

from __future__ import annotations

import collections
import os

import pytest
import tablefns

import gangrun
import tablewriters as tw
from s3server import moto_s3

pytest.importorskip("pyarrow")
pytest.importorskip("deltalake")


@pytest.fixture(scope="module")
def s3():
    """(endpoint_url, fsspec storage options) of a moto S3 server with an empty bucket ``tables``."""
    with moto_s3("tables") as server:
        yield server


def _table(kind, where, s3, tmp_path):
    """(source, fsspec options, every id, ids of Delta version 0) of a fresh table."""
    if where == "s3":
        endpoint, opts = s3
        root = f"s3://tables/{tmp_path.name}-{kind}"
    else:
        endpoint, opts, root = None, {}, str(tmp_path / kind)
    if kind == "parquet":
        return root, opts, tw.write_parquet(root, opts), None
    ids0, ids = tw.write_delta(root, endpoint)
    return root, opts, ids, ids0


def _gang(fn):
    return gangrun.distributed(processes=2, timeout=180)(fn)


def _flat(batches):
    return [i for b in batches for i in b]


@pytest.mark.slow
@pytest.mark.parametrize("where", ["local", "s3"])
@pytest.mark.parametrize("kind", ["parquet", "delta"])
def test_two_ranks_every_row_once_per_epoch(s3, tmp_path, kind, where):
    source, opts, ids, ids0 = _table(kind, where, s3, tmp_path)
    out = _gang(tablefns.epochs).distributed(source, opts, str(tmp_path / "cache"), [0, 2, 3])
    r0, r1 = sorted(out, key=lambda r: r["rank"])
    for nw in ("0", "2", "3"):
        a, b = r0[nw], r1[nw]
        for epoch in ("e0", "e1"):
            # equal batches per rank, of equal sizes: DDP never waits on a rank that ran out
            assert [len(x) for x in a[epoch]] == [len(x) for x in b[epoch]], (nw, epoch)
            assert len(a[epoch]) == a["len"] == b["len"]
            counts = collections.Counter(_flat(a[epoch]) + _flat(b[epoch]))
            assert set(counts) == ids, (nw, epoch)
            # 3000 Delta rows split exactly; 3001 Parquet rows: one padded (read twice)
            assert sum(counts.values()) == len(ids) + len(ids) % 2
        # a different order per epoch (same seed), the same rows
        assert _flat(a["e0"]) != _flat(a["e1"])
        # resume after 5 batches: exactly the rows not yet seen
        for r in (a, b):
            head, rest = _flat(r["head"]), _flat(r["rest"])
            assert len(r["head"]) == 5 and not set(head) & set(rest)
            assert sorted(head + rest) == sorted(_flat(r["e1"]))
        if nw == "0":  # without workers the order is the uninterrupted epoch's
            assert _flat(a["head"]) + _flat(a["rest"]) == _flat(a["e1"])
    if kind == "delta":  # version 0, read by both ranks: every row of it once
        assert sorted(r0["v0"] + r1["v0"]) == sorted(ids0)
    # the same order whatever the worker count
    assert sorted(_flat(r0["0"]["e0"])) == sorted(_flat(r0["3"]["e0"]))
    if where == "s3":  # both ranks and all workers filled one node cache: one entry per file
        # (the keys come from the ranks: deltalake in this process would block on the GIL
        # that the in-process moto server needs)
        assert sorted(os.listdir(tmp_path / "cache" / "data")) == r0["keys"] == r1["keys"]


@pytest.mark.slow
def test_resume_after_restart_through_checkpoint(s3, tmp_path):
    source, opts, ids, _ = _table("delta", "s3", s3, tmp_path)
    root = str(tmp_path / "ckpt")
    cache = str(tmp_path / "cache")
    train = _gang(tablefns.train_part)
    first = train.distributed(source, opts, cache, root, 4, 2)
    second = train.distributed(source, opts, cache, root, 1000, 2)
    seen = []
    for rank in range(2):
        assert first[rank]["step"] == 4 and len(first[rank]["seen"]) == 4
        head, rest = _flat(first[rank]["seen"]), _flat(second[rank]["seen"])
        assert not set(head) & set(rest)
        assert len(head) + len(rest) == len(ids) // 2
        seen += head + rest
    assert sorted(seen) == sorted(ids)  # every row of the epoch, exactly once


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_a_corrupt_page_is_named_in_the_callers_error(tmp_path, workers):
    """A data page overwritten in the middle (the footer intact) fails the call with an error
    naming the file, the row group and the rank (not only "Unexpected end of stream" or
    "Caught OSError in DataLoader worker", naming nothing). Direct iteration, the scanner
    path, the hand-over and the cache fills: tests/unit/test_read_errors.py."""
    source = str(tmp_path / "pq")
    tw.write_parquet(source)
    bad = os.path.join(source, "part-002.parquet")  # rows 2000..3000: rank 1's
    tw.corrupt_page(bad, row_group=1, column=1)
    with pytest.raises(gangrun.DistributedError) as info:
        _gang(tablefns.read_all).distributed(source, str(tmp_path / "cache"), workers)
    err = info.value
    assert err.rank == 1 and err.exc_type.endswith("DataReadError"), (err.rank, err.exc_type)
    text = str(err)
    first = text.splitlines()[0]  # also when a DataLoader worker raised it
    assert "on rank 1 " in first or "on rank 1 (" in first, text
    assert f"could not read row group 1 of {bad!r}" in first, text
    assert "Unexpected end of stream" in text, text
    if workers:
        assert "(DataLoader worker " in text, text
