"""One split module for both datasets (`gangrun.data.split`): the epoch orders of files and of
row groups pinned to what they were before they shared it (a checkpoint's position, and an
epoch's order, must not change under a run), one strict ``rank_world``, one position record."""

from __future__ import annotations

import pytest

from gangrun.data import split

# computed on the code before the split module: sharding.epoch_order, table.plan.unit_order
PINNED = {
    (10, 0, 0): ([9, 3, 7, 5, 2, 1, 4, 0, 6, 8], [1, 7, 6, 5, 9, 0, 8, 3, 4, 2]),
    (10, 3, 2): ([8, 7, 5, 3, 0, 2, 4, 6, 9, 1], [8, 5, 7, 3, 1, 6, 4, 0, 9, 2]),
    (17, 7, 5): (
        [2, 5, 12, 11, 1, 15, 13, 9, 0, 4, 14, 3, 16, 6, 8, 10, 7],
        [1, 10, 16, 2, 4, 15, 8, 3, 7, 11, 0, 5, 13, 12, 6, 9, 14],
    ),
}


def test_orders_are_the_ones_before_the_split_module():
    from gangrun.data import sharding
    from gangrun.data.table import plan

    for (n, seed, epoch), (files, rows) in PINNED.items():
        assert split.epoch_order(n, True, seed, epoch, "files") == files
        assert split.epoch_order(n, True, seed, epoch, "rows") == rows
        assert sharding.epoch_order(n, True, seed, epoch) == files
        assert plan.unit_order(n, True, seed, epoch) == rows
    assert split.epoch_order(5, False, 1, 1, "rows") == [0, 1, 2, 3, 4]
    assert plan.block_seed(7, 1, 30, 2) == 8534869339513141008


@pytest.mark.parametrize("what", ["VolumeDataset", "TableDataset"])
def test_rank_without_world_size_is_an_error_that_says_what_to_set(monkeypatch, what):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(
        ValueError, match=f"{what}: RANK is set \\(0\\) but WORLD_SIZE is not; set both"
    ):
        split.rank_world(what=what)
    monkeypatch.delenv("RANK")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="WORLD_SIZE is set \\(2\\) but RANK is not"):
        split.rank_world(what=what)
    monkeypatch.setenv("RANK", "1")
    assert split.rank_world(what=what) == (1, 2)
    assert split.rank_world(0, 3, what=what) == (0, 3)
    with pytest.raises(ValueError, match="rank 3 is outside world size 2"):
        split.rank_world(3, 2, what=what)
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    assert split.rank_world(what=what) == (0, 1)


def test_volume_dataset_refuses_rank_without_world_size(tmp_path, monkeypatch):
    # before: a VolumeDataset read every file as rank 0 of 1 on every process (duplicates)
    from gangrun.data import VolumeDataset

    (tmp_path / "a.bin").write_bytes(b"x")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="VolumeDataset: RANK is set"):
        VolumeDataset(str(tmp_path))
    assert VolumeDataset(str(tmp_path), rank=0, world_size=1).rank_world() == (0, 1)


def test_one_position_record_for_both_datasets():
    files = split.position(3, 2, 2, 5, files=12)
    rows = split.position(3, 2, 2, 5, rows=100, batch_size=10, table="fp")
    common = {"epoch": 3, "world_size": 2, "num_workers": 2, "seed": 5, "workers": [None, None]}
    assert files == {**common, "files": 12}
    assert rows == {**common, "rows": 100, "batch_size": 10, "table": "fp"}
    assert split.same_layout(files, 2, 2) and not split.same_layout(files, 3, 2)
    assert split.same_layout(rows, 2, 2, batch_size=10)
    assert not split.same_layout(rows, 2, 2, batch_size=11)
