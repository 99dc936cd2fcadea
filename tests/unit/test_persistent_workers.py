"""``persistent_workers=True`` (the default of ``ds.loader(num_workers=N)``): the DataLoader
workers start once, yet every pass reads the epoch and resume position the training process
set (`gangrun.data.loader.EpochChannel`), a pass left midway frees the pool blocks its
chunks took, and dropping the loader ends its workers and gives the blocks back."""

from __future__ import annotations

import gc
import json
import multiprocessing
import os

import pytest

import tablewriters as tw
from gangrun.data import TableDataset, VolumeDataset

torch = pytest.importorskip("torch")
pytest.importorskip("pyarrow")

_FORKS: dict[str, str | None] = {"log": None}


def _note_fork() -> None:  # in every child forked from the test process while a log is set
    path = _FORKS["log"]
    if path is not None:
        with open(path, "a") as f:
            f.write(f"{os.getpid()}\n")


os.register_at_fork(after_in_child=_note_fork)


@pytest.fixture
def forks(tmp_path):
    """A function returning how many processes were forked since the test began."""
    path = tmp_path / "forks"
    path.write_text("")
    _FORKS["log"] = str(path)
    yield lambda: len(path.read_text().split())
    _FORKS["log"] = None


@pytest.fixture
def root(tmp_path):
    path = str(tmp_path / "pq")
    tw.write_parquet(path)
    return path


def _pooled(ds: TableDataset, batch) -> bool:
    return tw.in_pool(ds, batch["id"].data_ptr())


def _pass(ds, loader, limit=None):
    """(ids of each batch, how many batches lived in the pool) of one pass."""
    out, pooled = [], 0
    for batch in loader:
        out.append(batch["id"].tolist())
        pooled += _pooled(ds, batch)
        if len(out) == limit:
            break
    return out, pooled


def _fresh(root, epoch, **kw):
    """Epoch ``epoch`` as workers started for it alone read it (persistent_workers=False)."""
    ds = TableDataset(root, **kw)
    ds.set_epoch(epoch)
    return _pass(ds, ds.loader(num_workers=2, persistent_workers=False))[0]


def _flat(batches):
    return [i for b in batches for i in b]


def test_table_workers_start_once_and_follow_every_epoch(root, forks):
    kw = dict(batch_size=50, shuffle=True, seed=3, shuffle_buffer=400)
    expected = [_fresh(root, e, **kw) for e in range(3)]
    before = forks()
    ds = TableDataset(root, **kw)
    loader = ds.loader(num_workers=2)
    assert loader.persistent_workers
    got = []
    for epoch in range(3):
        ds.set_epoch(epoch)
        batches, pooled = _pass(ds, loader)
        assert pooled == len(batches)  # every batch through the blocks kept for the workers
        got.append(batches)
    assert forks() - before == 2  # two workers, started by the first epoch only
    assert got == expected  # each epoch's order, as workers started for it read it
    assert len({json.dumps(g) for g in got}) == 3
    for g in got:
        assert sorted(_flat(g)) == list(range(tw.PARQUET_ROWS))
    pool = ds.pool
    assert pool is not None and pool.busy  # lent to the live workers
    del loader, batches, g, got
    gc.collect()
    assert multiprocessing.active_children() == []  # the loader's workers ended with it
    assert not pool.busy  # and the blocks are free for the next loader


def test_a_persistent_pass_left_midway_frees_its_blocks(root):
    """The chunks the workers made for a pass the loop left are dropped unread; their
    blocks are free again when the workers start the next pass (else every later chunk
    would take the slow fallbacks)."""
    ds = TableDataset(root, batch_size=10)
    loader = ds.loader(num_workers=2)
    head, _ = _pass(ds, loader, limit=5)
    assert len(head) == 5
    for _ in range(2):
        batches, pooled = _pass(ds, loader)
        assert sorted(_flat(batches)) == list(range(tw.PARQUET_ROWS))
        assert pooled == len(batches)


def test_resume_mid_epoch_on_the_same_persistent_loader(root):
    kw = dict(batch_size=64, shuffle=True, seed=9, shuffle_buffer=300)
    full = _fresh(root, 1, **kw)
    ds = TableDataset(root, **kw)
    loader = ds.loader(num_workers=2)
    ds.set_epoch(0)
    _pass(ds, loader)  # the workers are started by epoch 0
    ds.set_epoch(1)
    head, _ = _pass(ds, loader, limit=5)
    state = json.loads(json.dumps(ds.state_dict()))
    ds.set_epoch(0)
    _pass(ds, loader, limit=3)  # another position in between
    ds.load_state_dict(state)
    rest, _ = _pass(ds, loader)
    assert not set(_flat(head)) & set(_flat(rest))
    assert sorted(_flat(head) + _flat(rest)) == sorted(_flat(full))


def test_volume_workers_start_once_and_follow_every_epoch(tmp_path, forks):
    src = tmp_path / "files"
    src.mkdir()
    for i in range(11):
        (src / f"f{i:02d}").write_bytes(f"f{i:02d}".encode())
    kw = dict(shuffle=True, seed=4, rank=0, world_size=1, decode=lambda b: b.decode())

    def fresh(epoch):
        ds = VolumeDataset(str(src), **kw)
        ds.set_epoch(epoch)
        return list(ds.loader(batch_size=None, num_workers=2, persistent_workers=False))

    expected = [fresh(e) for e in range(3)]
    assert expected[0] != expected[1]
    before = forks()
    ds = VolumeDataset(str(src), **kw)
    loader = ds.loader(batch_size=None, num_workers=2)
    got = []
    for epoch in range(3):
        ds.set_epoch(epoch)
        got.append(list(loader))
    assert got == expected and forks() - before == 2
    # resume mid-epoch through the same workers
    ds.set_epoch(2)
    head = []
    for s in loader:
        head.append(s)
        if len(head) == 4:
            break
    state = ds.state_dict()
    ds.set_epoch(0)
    list(loader)
    ds.load_state_dict(state)
    assert sorted(head + list(loader)) == sorted(expected[2])
    del loader
    gc.collect()
    assert multiprocessing.active_children() == []
