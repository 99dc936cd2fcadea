"""Every read error of a table or a volume names the file (for a table, the row group), the
rank and the DataLoader worker, with the original error chained (a corrupt data page
must not fail with only "Couldn't deserialize thrift ..." or "Caught OSError in DataLoader
worker", naming nothing).

Real Parquet files with bytes overwritten in a data page (the footer intact), files removed
after they were listed, a volume file that does not decode; read directly and through the
loaders with 0 and 2 workers. The same through a real 2-rank gangrun call:
tests/system/test_tables.py::test_a_corrupt_page_is_named_in_the_callers_error."""

from __future__ import annotations

import os
import pickle
import re
import uuid

import pytest

import tablewriters as tw
from gangrun.data import DataReadError, TableDataset, VolumeDataset

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def _drain(ds, workers):
    """Every batch of ``ds``: directly (``None``) or through its loader with ``workers``."""
    it = ds if workers is None else ds.loader(num_workers=workers)
    return sum(1 for _ in it)


def _raised(ds, workers) -> DataReadError:
    with pytest.raises(DataReadError) as info:
        _drain(ds, workers)
    _shut_down_workers(info.value)
    return info.value


def _shut_down_workers(err: BaseException) -> None:
    """Stop the workers of the failed pass now. torch's re-raised worker error is in a
    reference cycle with the DataLoader iterator; collected by the garbage collector, the
    iterator's queues are closed before its ``__del__`` can tell the workers to stop, and it
    waits 5 s for each (plain torch does the same)."""
    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

    tb = err.__traceback__
    while tb is not None:
        it = tb.tb_frame.f_locals.get("self")
        if isinstance(it, _MultiProcessingDataLoaderIter):
            it._shutdown_workers()
        tb = tb.tb_next


def _check(err, path, row_group, original, workers, doing="could not read"):
    text = str(err)
    where = f"{path!r}" if row_group is None else f"row group {row_group} of {path!r}"
    assert "on rank 1 " in text or "on rank 1 (" in text, text
    assert f"{doing} {where}" in text.splitlines()[0], text  # the first line names it
    assert re.search(original, text), text
    if workers:  # rebuilt by the DataLoader from the worker's message: the traceback is in it
        assert "(DataLoader worker " in text and "direct cause" in text, text
    else:  # raised here: the original is chained
        cause = err.__cause__
        assert cause is not None and re.search(original, f"{type(cause).__name__}: {cause}")


@pytest.fixture
def parquet(tmp_path):
    root = str(tmp_path / "pq")
    tw.write_parquet(root)
    return root


def _table(root, tmp_path, **kw):
    """Rank 1 of 2: rows 1501.. of the 3001 (part-001, part-002; one padded row of part-000)."""
    return TableDataset(
        root, rank=1, world_size=2, batch_size=100, cache_dir=str(tmp_path / "c"), **kw
    )


@pytest.mark.parametrize("workers", [None, 0, 2])
@pytest.mark.parametrize(
    ("at", "original"),
    [("header", "Couldn't deserialize thrift"), ("middle", "Unexpected end of stream")],
)
def test_a_corrupt_data_page_names_file_and_row_group(parquet, tmp_path, workers, at, original):
    path = os.path.join(parquet, "part-002.parquet")
    tw.corrupt_page(path, row_group=1, column=1, at=at)  # column x of rows 2097..2193
    err = _raised(_table(parquet, tmp_path), workers)
    _check(err, path, 1, original, workers)


@pytest.mark.parametrize("workers", [None, 2])
def test_a_corrupt_page_read_by_the_dataset_scanner_is_named(parquet, tmp_path, workers):
    """With a filter the row group is read by pyarrow's dataset scanner, not straight."""
    path = os.path.join(parquet, "part-002.parquet")
    tw.corrupt_page(path, row_group=2, column=1)  # x: not read to count the filter's rows
    ds = _table(parquet, tmp_path, columns=["id", "x"], filter=[("id", ">=", 0)])
    _check(_raised(ds, workers), path, 2, "Unexpected end of stream", workers)


def test_a_corrupt_page_while_counting_a_filter_is_named(parquet, tmp_path):
    path = os.path.join(parquet, "part-001.parquet")
    tw.corrupt_page(path, row_group=0, column=0)
    with pytest.raises(DataReadError) as info:  # the rows are counted when it is made
        _table(parquet, tmp_path, filter=[("id", ">=", 0)])
    assert f"row group 0 of {path!r}" in str(info.value)
    assert "Unexpected end of stream" in str(info.value.__cause__)


@pytest.mark.parametrize("output", ["torch", "numpy"])
@pytest.mark.parametrize("workers", [None, 0, 2])
def test_a_damaged_column_is_named_when_converted_or_handed_over(tmp_path, output, workers):
    """Invalid UTF-8 reads without an error; it fails in the conversion (in this process) or
    in the workers' Arrow hand-over (`table.handover`), which name the row group too."""
    root = tmp_path / "utf"
    root.mkdir()
    path = str(root / "a.parquet")
    tw.write_bad_utf8(path)
    err = _raised(_table(str(root), tmp_path, output=output), workers)
    doing = "could not hand over the rows of" if workers and output == "torch" else None
    doing = doing or "could not convert the rows of"
    _check(err, path, 1, "UnicodeDecodeError|Wrapping", workers, doing)


@pytest.mark.parametrize("workers", [None, 2])
def test_a_remote_file_gone_before_its_cache_fill_is_named(tmp_path, workers):
    import fsspec

    root = f"memory://{uuid.uuid4().hex}"
    try:
        tw.write_parquet(root)
        ds = _table(root, tmp_path)  # listed, footers read (not cached)
        gone = f"/{root[len('memory://') :]}/part-001.parquet"
        fsspec.filesystem("memory").rm(gone)
        err = _raised(ds, workers)
        _check(err, gone, None, "FileNotFoundError", workers, "could not copy into the node cache")
    finally:
        fsspec.filesystem("memory").rm(root.replace("memory://", "/"), recursive=True)


def test_the_error_pickles_and_says_what_to_do(parquet, tmp_path):
    path = os.path.join(parquet, "part-001.parquet")
    tw.corrupt_page(path, row_group=0, column=0)
    err = _raised(_table(parquet, tmp_path), None)
    assert isinstance(err, OSError) and "rewrite or remove it" in str(err)
    again = pickle.loads(pickle.dumps(err))  # a rank's error travels to the caller pickled
    assert type(again) is DataReadError and str(again) == str(err)


# -- VolumeDataset --------------------------------------------------------------------------


def _decode(data: bytes) -> int:
    return pickle.loads(data)


@pytest.fixture
def volume(tmp_path):
    root = tmp_path / "vol"
    root.mkdir()
    for i in range(6):
        (root / f"f{i}.pkl").write_bytes(pickle.dumps(i))
    return root


@pytest.mark.parametrize("workers", [None, 0, 2])
def test_a_volume_file_that_does_not_decode_is_named(volume, workers):
    bad = volume / "f3.pkl"  # rank 1 of 2 reads f1, f3, f5
    bad.write_bytes(b"\x80\x05 not a pickle")
    ds = VolumeDataset(str(volume), decode=_decode, rank=1, world_size=2)
    err = _raised(ds, workers)
    _check(err, str(bad), None, "UnpicklingError", workers, "could not decode")
    assert f"{str(bad)!r} (decode=_decode)" in str(err)


@pytest.mark.parametrize("workers", [None, 2])
def test_a_volume_file_removed_after_listing_is_named(volume, workers):
    ds = VolumeDataset(str(volume), rank=1, world_size=2)
    gone = volume / "f5.pkl"
    gone.unlink()
    err = _raised(ds, workers)
    _check(err, str(gone), None, "FileNotFoundError", workers)


@pytest.mark.parametrize("workers", [None, 2])
def test_a_remote_volume_file_gone_before_its_cache_fill_is_named(tmp_path, workers):
    """The fill runs in the prefetch threads: their error names the file too."""
    import fsspec

    root = f"memory://{uuid.uuid4().hex}"
    fs = fsspec.filesystem("memory")
    try:
        for i in range(6):
            fs.pipe_file(f"{root}/f{i}.bin", bytes([i]) * 10)
        ds = VolumeDataset(root, rank=1, world_size=2, cache_dir=str(tmp_path / "c"), prefetch=3)
        gone = f"/{root[len('memory://') :]}/f5.bin"
        fs.rm(gone)
        err = _raised(ds, workers)
        _check(err, gone, None, "FileNotFoundError", workers)
    finally:
        fs.rm(root.replace("memory://", "/"), recursive=True)
