"""A loader stopped after any batch and resumed from its ``state_dict`` hands out exactly the
batches the uninterrupted loader would have, in the same order, into the next epoch too.

With workers, a DataLoader hands batches out round-robin starting each pass at worker 0: a
pass resumed where the next batch was another worker's must still start there (with 2
workers, a checkpoint at an odd batch must not swap the next two batches).
"""

from __future__ import annotations

import os

import pytest

import tablewriters as tw
from gangrun.data import TableDataset, VolumeDataset

torch = pytest.importorskip("torch")
pytest.importorskip("pyarrow")

EPOCHS = 2


def _files(root: str, n: int = 11) -> str:
    os.makedirs(root, exist_ok=True)
    for i in range(n):
        with open(os.path.join(root, f"f{i:02d}.bin"), "wb") as f:
            f.write(i.to_bytes(2, "little") * 3)  # one sample of 3 items per file
    return root


def _decode(raw: bytes) -> list[int]:
    return [int.from_bytes(raw[:2], "little")]


def _volume(root: str, workers: int, persistent: bool):
    ds = VolumeDataset(root, shuffle=True, seed=3, decode=_decode)
    return ds, ds.loader(batch_size=2, num_workers=workers, persistent_workers=persistent)


def _table(root: str, workers: int, persistent: bool, transform: bool):
    kw = {"transform": (lambda b: b)} if transform else {}
    ds = TableDataset(root, batch_size=97, shuffle=True, seed=4, shuffle_buffer=300, **kw)
    return ds, ds.loader(num_workers=workers, persistent_workers=persistent)


def _key(batch) -> tuple[int, ...]:
    if isinstance(batch, dict):
        return tuple(int(v) for v in batch["id"][:3].tolist())
    return tuple(int(v) for v in torch.cat([torch.as_tensor(b).flatten() for b in batch]))


def _run(make, state=None, stop_after=None):
    """The batch keys from the start (or ``state``) to the end of the last epoch; with
    ``stop_after``, (keys, state) after that many batches."""
    ds, loader = make()
    if state is not None:
        loader.load_state_dict(state)
    out = []
    while ds.epoch < EPOCHS:
        for batch in loader:
            out.append(_key(batch))
            if stop_after is not None and len(out) == stop_after:
                return out, loader.state_dict()
        ds.set_epoch(ds.epoch + 1)
    return out, None


def _check_every_cut(make, cuts=None):
    straight, _ = _run(make)
    assert len(set(straight)) > len(straight) // 2  # batches tell apart
    for k in cuts if cuts is not None else range(1, len(straight)):
        head, state = _run(make, stop_after=k)
        tail, _ = _run(make, state=state)
        assert head + tail == straight, f"resumed after batch {k} of {len(straight)}"


@pytest.mark.parametrize("workers", [2, 3])
def test_volume_loader_resumes_in_order_after_any_batch(tmp_path, workers):
    root = _files(str(tmp_path / "v"))
    _check_every_cut(lambda: _volume(root, workers, persistent=False))


def test_volume_loader_kept_workers_resume_in_order(tmp_path):
    root = _files(str(tmp_path / "v"))
    _check_every_cut(lambda: _volume(root, 2, persistent=True), cuts=[1, 3, 5, 7])


@pytest.mark.parametrize("workers", [0, 1])
def test_volume_loader_few_workers_resume_in_order(tmp_path, workers):
    root = _files(str(tmp_path / "v"))
    _check_every_cut(lambda: _volume(root, workers, persistent=False), cuts=[1, 2, 5, 7])


@pytest.fixture(scope="module")
def table_root(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("pq") / "t")
    tw.write_parquet(root)
    return root


@pytest.mark.parametrize("workers", [2, 3])
def test_table_loader_resumes_in_order_after_any_batch(table_root, workers):
    # chunks of 1, 2, 4, ... batches: the order must not depend on where a pass started
    _check_every_cut(
        lambda: _table(table_root, workers, persistent=False, transform=False),
        cuts=[1, 2, 3, 4, 5, 7, 9, 13, 16, 17, 20, 25, 31],
    )


def test_table_loader_kept_workers_and_transform_resume_in_order(table_root):
    _check_every_cut(lambda: _table(table_root, 2, persistent=True, transform=False), [3, 7, 18])
    _check_every_cut(lambda: _table(table_root, 2, persistent=False, transform=True), [1, 3, 18])
