"""The rest of an epoch continued on another number of ranks and workers.

A world of ``W`` ranks reads part of an epoch through each rank's loader and saves every
rank's state; a world of ``M`` ranks loads the merged states (what `gangrun.Checkpointer`
restores onto another world size) and reads the rest. Across both worlds every sample of the
epoch is read exactly once (but for the new world's ``pad`` of the rest to equal shares), and the next
epoch is what ``M`` ranks read uninterrupted. Configurations are drawn from a fixed seed
(files decoding to 1-4 samples each, shuffled or not, 0-2 DataLoader workers, any cut).
"""

from __future__ import annotations

import collections
import json
import os
import random

import pytest

from gangrun.data import TableDataset, VolumeDataset

torch = pytest.importorskip("torch")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

N_FILES = 12  # splits evenly over 1, 2, 3 and 4 ranks


def _files(root: str) -> str:
    os.makedirs(root, exist_ok=True)
    for i in range(N_FILES):
        count = 1 + (i * 7) % 4
        with open(os.path.join(root, f"f{i:02d}.json"), "w") as f:
            json.dump([i * 10 + j for j in range(count)], f)
    return root


def _decode(raw: bytes):
    return iter(json.loads(raw))


def _volume(root, rank, world, workers, shuffle, batch):
    ds = VolumeDataset(root, shuffle=shuffle, seed=5, decode=_decode, rank=rank, world_size=world)
    return ds, ds.loader(batch_size=batch, num_workers=workers, persistent_workers=False)


def _flat(batch) -> list[int]:
    if isinstance(batch, dict):
        return [int(v) for v in batch["id"].tolist()]
    return [int(v) for v in torch.as_tensor(batch).flatten().tolist()]


def _world(make, world, workers, cut=None, states=None, then=None):
    """Each rank's samples of epoch 0 (to the end, or ``cut`` batches), and the state of
    every rank; ``then``: each rank's samples of epoch 1 too, read after it by the same
    loader, appended to ``then``."""
    out, saved = [], {}
    for r in range(world):
        ds, loader = make(r, world, workers)
        if states is not None:
            loader.load_state_dict(states)
        got = []
        for i, batch in enumerate(loader):
            got += _flat(batch)
            if cut is not None and i + 1 == cut:
                break
        out.append(got)
        saved.update(loader.state_dict())  # every rank's position (rank<R> keys) in one
        if then is not None:
            ds.set_epoch(1)
            then.append([x for b in loader for x in _flat(b)])
    return out, saved


def _chain(make, worlds):
    """Worlds ``(ranks, workers, cut)`` each continuing the one before (the last reads to the
    epoch's end): how often each sample was read across them, and each world's states."""
    read, states, saved = collections.Counter(), [], None
    for world, workers, cut in worlds:
        got, saved = _world(make, world, workers, cut=cut, states=saved)
        read.update(x for part in got for x in part)
        states.append(saved)
    return read, states


def _check(make, total, old, new, w_old, w_new, cut):
    head, states = _world(make, old, w_old, cut=cut)
    after: list[list[int]] = []
    tail, _ = _world(make, new, w_new, states=states, then=after)
    read = collections.Counter(x for part in head + tail for x in part)
    assert sorted(read) == sorted(total), "a sample of the epoch was not read"
    # the only repeats: the new world's padding of the rest to equal shares (uneven="pad":
    # fewer than `new` files, or rows, from the rest's beginning)
    twice = {x: c for x, c in read.items() if c > 1}
    assert max(twice.values(), default=2) == 2, twice
    units = {x // 10 for x in twice} if make.__name__ != "table" else set(twice)
    assert len(units) <= new - 1, f"read twice across the {old} and the {new} ranks: {twice}"
    lens = {len(t) for t in tail}
    assert len(lens) <= 1 or make.__name__ != "table", f"ranks uneven after resume: {lens}"
    # the next epoch is what `new` ranks read uninterrupted
    straight: list[list[int]] = []
    _world(make, new, w_new, then=straight)
    assert after == straight


def test_volume_rest_of_the_epoch_on_another_world_every_sample_once(tmp_path):
    root = _files(str(tmp_path / "v"))
    total = [i * 10 + j for i in range(N_FILES) for j in range(1 + (i * 7) % 4)]
    rnd = random.Random(2029)
    for _ in range(24):
        old, new = rnd.choice([1, 2, 3, 4]), rnd.choice([1, 2, 3, 4])
        shuffle, batch = rnd.random() < 0.7, rnd.choice([1, 2, 3])
        cut = rnd.randint(1, 3)

        def make(r, w, workers, shuffle=shuffle, batch=batch):
            return _volume(root, r, w, workers, shuffle, batch)

        _check(make, total, old, new, 0, 0, cut)


@pytest.mark.parametrize("old,new,w_old,w_new", [(2, 3, 2, 1), (3, 1, 1, 2), (2, 2, 2, 1)])
def test_volume_rest_with_dataloader_workers(tmp_path, old, new, w_old, w_new):
    # a rank's share read by real DataLoader worker processes, before and after
    root = _files(str(tmp_path / "v"))
    total = [i * 10 + j for i in range(N_FILES) for j in range(1 + (i * 7) % 4)]

    def make(r, w, workers):
        return _volume(root, r, w, workers, True, 2)

    _check(make, total, old, new, w_old, w_new, cut=2)


def _write_table(root: str, rows: int = 1200) -> list[int]:
    os.makedirs(root, exist_ok=True)
    per = rows // 4
    for f in range(4):
        ids = list(range(f * per, (f + 1) * per))
        t = pa.table({"id": pa.array(ids, pa.int64()), "x": pa.array([float(i) for i in ids])})
        pq.write_table(t, os.path.join(root, f"p{f}.parquet"), row_group_size=70)
    return list(range(rows))


def table(r, w, workers, *, root, shuffle, batch, buf):
    ds = TableDataset(
        root,
        batch_size=batch,
        shuffle=shuffle,
        seed=9,
        shuffle_buffer=buf,
        rank=r,
        world_size=w,
    )
    return ds, ds.loader(num_workers=workers, persistent_workers=False)


def test_table_rest_of_the_epoch_on_another_world_every_row_once(tmp_path):
    root = str(tmp_path / "t")
    total = _write_table(root)  # 1200 rows: even over 1-4 ranks
    rnd = random.Random(4242)
    for _ in range(16):
        old, new = rnd.choice([1, 2, 3, 4]), rnd.choice([1, 2, 3, 4])
        shuffle, batch, buf = rnd.random() < 0.7, rnd.choice([25, 50, 100]), rnd.choice([64, 333])
        cut = rnd.randint(1, 4)

        def make(r, w, workers, shuffle=shuffle, batch=batch, buf=buf):
            return table(r, w, workers, root=root, shuffle=shuffle, batch=batch, buf=buf)

        make.__name__ = "table"
        _check(make, total, old, new, 0, 0, cut)


@pytest.mark.parametrize("old,new,w_old,w_new", [(2, 3, 2, 1), (2, 1, 1, 2)])
def test_table_rest_with_dataloader_workers(tmp_path, old, new, w_old, w_new):
    root = str(tmp_path / "t")
    total = _write_table(root)

    def make(r, w, workers):
        return table(r, w, workers, root=root, shuffle=True, batch=50, buf=128)

    make.__name__ = "table"
    _check(make, total, old, new, w_old, w_new, cut=3)


def test_interrupted_twice_on_three_worlds(tmp_path):
    # 2 ranks, then 3 (its pass is a rest), interrupted again, then 1: still every row once
    root = str(tmp_path / "t")
    total = _write_table(root)

    def make(r, w, workers):
        return table(r, w, workers, root=root, shuffle=True, batch=40, buf=100)

    read, _ = _chain(make, [(2, 0, 3), (3, 0, 2), (1, 0, None)])
    assert sorted(read) == total and max(read.values()) == 1


def test_same_world_other_worker_count_continues_each_rank_alone(tmp_path):
    # only this rank's own position at hand (the same world): the rank continues its share
    root = _files(str(tmp_path / "v"))
    total = [i * 10 + j for i in range(N_FILES) for j in range(1 + (i * 7) % 4)]
    head, tail = [], []
    for r in range(2):
        ds, loader = _volume(root, r, 2, 2, True, 2)
        got = []
        for i, b in enumerate(loader):
            got += _flat(b)
            if i == 1:
                break
        head.append(got)
        ds2, loader2 = _volume(root, r, 2, 0, True, 2)
        loader2.load_state_dict(loader.state_dict())  # its own rank's key only
        tail.append([x for b in loader2 for x in _flat(b)])
    read = collections.Counter(x for part in head + tail for x in part)
    assert sorted(read) == sorted(total) and max(read.values()) == 1


def test_partial_positions_restart_the_epoch_with_a_warning(tmp_path):
    # rank 0's position alone, saved by 2 ranks, cannot give the rest on 3: said, not guessed
    root = _files(str(tmp_path / "v"))
    ds, loader = _volume(root, 0, 2, 0, True, 2)
    next(iter(loader))
    state = loader.state_dict()
    ds3, loader3 = _volume(root, 0, 3, 0, True, 2)
    loader3.load_state_dict(state)
    with pytest.warns(UserWarning, match="1 of the 2 ranks"):
        got = [x for b in loader3 for x in _flat(b)]
    fresh = [x for b in _volume(root, 0, 3, 0, True, 2)[1] for x in _flat(b)]
    assert got == fresh


def test_len_of_a_loader_is_the_datasets(tmp_path):
    # len(loader) for a scheduler's total steps: as a DataLoader over the dataset itself
    root = _files(str(tmp_path / "v"))  # one sample a file (no decode): 6 on rank 0 of 2
    loader = VolumeDataset(root, rank=0, world_size=2).loader(batch_size=4, num_workers=0)
    assert len(loader) == 2 == len(list(loader))
    tdir = str(tmp_path / "t")
    _write_table(tdir)
    t, tl = table(0, 2, 0, root=tdir, shuffle=False, batch=50, buf=64)
    assert len(tl) == len(t) == 12 == len(list(tl))


def test_rank_scope_rest_then_another_world(tmp_path):
    # 2 ranks x 2 workers, cut; the same 2 ranks without workers (each continues its own
    # share: a rank-scoped rest), cut again; then 3 ranks: every row once overall
    root = str(tmp_path / "t")
    total = _write_table(root)

    def make(r, w, workers):
        return table(r, w, workers, root=root, shuffle=True, batch=30, buf=90)

    read, states = _chain(make, [(2, 2, 3), (2, 0, 4), (3, 0, None)])
    assert all("base" in json.loads(v) for k, v in states[1].items() if k.startswith("rank"))
    assert sorted(read) == total and max(read.values()) == 1


@pytest.mark.parametrize("uneven", ["pad", "drop"])
def test_uneven_counts_repeat_or_leave_fewer_than_a_world(tmp_path, uneven):
    # 13 files over 2 then 3 ranks: pad repeats fewer than `new` files, drop leaves fewer
    # than `old` + `new` unread (each world cuts its own end); nothing else is repeated or lost
    root = str(tmp_path / "v")
    os.makedirs(root)
    for i in range(13):
        with open(os.path.join(root, f"f{i:02d}.json"), "w") as f:
            json.dump([i], f)

    def make(r, w, workers):
        ds = VolumeDataset(
            root, shuffle=True, seed=2, decode=_decode, rank=r, world_size=w, uneven=uneven
        )
        return ds, ds.loader(batch_size=1, num_workers=workers)

    head, states = _world(make, 2, 0, cut=2)
    tail, _ = _world(make, 3, 0, states=states)
    read = collections.Counter(x for part in head + tail for x in part)
    if uneven == "pad":
        assert set(read) == set(range(13)) and sum(read.values()) - 13 <= 2
    else:
        # the old world's drop (1 file) and the new world's of the rest (fewer than 3)
        assert max(read.values()) == 1 and 13 - len(read) <= 1 + 2
        assert len({len(t) for t in tail}) == 1  # every new rank reads as many
