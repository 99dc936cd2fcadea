"""A plain ``torch.utils.data.DataLoader`` in the Checkpointer's state resumes mid-pass in
exactly the uninterrupted order (docs/long_runs.md, "Data loaders"): its generator's state as
the pass drew its order, and the batches the pass had handed out, are saved; the resumed pass
draws the same order and skips those batches without loading them."""

from __future__ import annotations

import pytest

import gangrun

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader, IterableDataset, TensorDataset  # noqa: E402

N, BATCH, EPOCHS = 20, 3, 2  # 7 batches per epoch, the last one short


class Counting(TensorDataset):
    loaded: list[int] = []

    def __getitem__(self, i):
        Counting.loaded.append(int(i))
        return super().__getitem__(i)


class Stream(IterableDataset):
    def __iter__(self):
        g = torch.Generator().manual_seed(9)
        yield from torch.randperm(N, generator=g).tolist()


def _loader(kind: str, workers: int = 0, persistent: bool = False):
    if kind == "stream":
        return DataLoader(Stream(), batch_size=BATCH)
    ds = Counting(torch.arange(N))
    g = torch.Generator().manual_seed(7)
    return DataLoader(
        ds,
        batch_size=BATCH,
        shuffle=True,
        generator=g,
        num_workers=workers,
        persistent_workers=persistent,
    )


def _keys(batch) -> tuple[int, ...]:
    b = batch[0] if isinstance(batch, (list, tuple)) else batch
    return tuple(int(v) for v in b.tolist())


def _run(where, make, stop_after=None):
    """Batches of EPOCHS epochs through a Checkpointer (restored from ``where``); with
    ``stop_after``: save after that many batches and stop."""
    loader = make()
    state = {"loader": loader, "epoch": 0}
    ckpt = gangrun.Checkpointer(state, dir=where, async_save=False)
    ckpt.restore()
    out, seen = [], 0
    while state["epoch"] < EPOCHS:
        for batch in loader:
            out.append(_keys(batch))
            seen += 1
            if stop_after is not None and seen == stop_after:
                ckpt.save()
                ckpt.close()
                return out
        state["epoch"] += 1
    ckpt.close()
    return out


@pytest.mark.parametrize(
    ("kind", "workers", "persistent"),
    [("map", 0, False), ("map", 2, False), ("map", 2, True), ("stream", 0, False)],
)
def test_plain_dataloader_resumes_in_the_uninterrupted_order(tmp_path, kind, workers, persistent):
    def make():
        return _loader(kind, workers, persistent)

    straight = _run(str(tmp_path / "straight"), make)
    assert len(straight) == 2 * 7 and (kind == "stream" or straight[:7] != straight[7:])
    # kept workers of a pass left midway take torch seconds to end: fewer cuts there
    cuts = [1, 2, 6, 7, 8, 13] if workers == 0 else [4, 8] if persistent else [1, 4, 7, 8, 11]
    for k in cuts:
        where = str(tmp_path / f"cut{k}")
        head = _run(where, make, stop_after=k)
        Counting.loaded = []
        tail = _run(where, make)
        assert head + tail == straight, f"resumed after batch {k}"
        if kind == "map" and workers == 0 and k < 7:  # skipped batches are not loaded
            assert len(Counting.loaded) == N * EPOCHS - k * BATCH


def test_a_dataloader_shuffled_by_the_global_generator_is_refused(tmp_path):
    loader = DataLoader(TensorDataset(torch.arange(N)), batch_size=BATCH, shuffle=True)
    ckpt = gangrun.Checkpointer({"loader": loader}, dir=str(tmp_path / "c"))
    with pytest.raises(TypeError, match=r"state\['loader'\] is a DataLoader .* generator="):
        ckpt.restore()


def test_a_tracked_loader_dropped_mid_pass_ends_its_kept_workers_at_once(tmp_path):
    # the pass-start sampler holds its loader weakly: dropping the loader frees it (and its
    # workers) by reference count, not in a later garbage collection 5 s per worker later
    import gc
    import time

    import psutil

    before = {c.pid for c in psutil.Process().children()}  # a fork server, say
    gc.disable()
    try:
        loader = _loader("map", workers=2, persistent=True)
        ckpt = gangrun.Checkpointer({"loader": loader}, dir=str(tmp_path / "c"))
        ckpt.restore()
        for i, _ in enumerate(loader):
            if i == 2:
                break
        ckpt.close()
        workers = [c for c in psutil.Process().children() if c.pid not in before]
        assert len(workers) == 2
        t = time.monotonic()
        del loader, ckpt, _
        while any(w.is_running() and w.status() != "zombie" for w in workers):
            assert time.monotonic() - t < 3, "the workers outlived their loader"
            time.sleep(0.05)
    finally:
        gc.enable()
