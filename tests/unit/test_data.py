"""VolumeDataset and FileCache in one process: ranks are simulated with RANK/WORLD_SIZE."""

from __future__ import annotations

import collections
import multiprocessing
import os
import time
import uuid
from pathlib import Path

import pytest

from conftest import run_python
from gangrun import checkpoint
from gangrun.data import FileCache, VolumeDataset
from gangrun.data.cache import parse_size

N = 7  # odd on purpose


def _fill(root: str, n: int = N, size: int = 0) -> set[bytes]:
    import fsspec
    from fsspec.core import url_to_fs

    fs, path = url_to_fs(root)
    fs.makedirs(path, exist_ok=True)
    names = set()
    for i in range(n):
        body = f"f{i:02d}".encode() + b"x" * size
        fs.pipe_file(f"{path}/f{i:02d}", body)
        names.add(body)
    del fsspec
    return names


@pytest.fixture(params=["local", "memory"])
def source(request, tmp_path):
    root = str(tmp_path / "src") if request.param == "local" else f"memory://{uuid.uuid4().hex}"
    names = _fill(root)
    yield root, names
    if request.param == "memory":
        import fsspec

        fsspec.filesystem("memory").rm(root.replace("memory://", "/"), recursive=True)


def _epoch(root, rank, world, monkeypatch, tmp_path, num_workers=0, epoch=0, **kw):
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world))
    ds = VolumeDataset(root, cache_dir=str(tmp_path / "cache"), shuffle=True, seed=5, **kw)
    ds.set_epoch(epoch)
    if num_workers:
        return [bytes(b) for b in ds.loader(batch_size=None, num_workers=num_workers)]
    return list(ds)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("uneven", ["pad", "drop"])
def test_every_file_once_per_epoch_equal_counts(source, monkeypatch, tmp_path, num_workers, uneven):
    root, names = source
    per_rank = [
        _epoch(root, r, 2, monkeypatch, tmp_path, num_workers, uneven=uneven) for r in range(2)
    ]
    assert len(per_rank[0]) == len(per_rank[1]) == (4 if uneven == "pad" else 3)
    counts = collections.Counter(per_rank[0] + per_rank[1])
    if uneven == "pad":
        assert set(counts) == names  # nothing skipped, one file read twice
        assert sorted(counts.values()) == [1] * 6 + [2]
    else:
        assert len(counts) == 6 and set(counts.values()) == {1} and set(counts) < names
    # Workers do not change what a rank reads, only the interleaving.
    if num_workers:
        same = _epoch(root, 0, 2, monkeypatch, tmp_path, 0, uneven=uneven)
        assert sorted(same) == sorted(per_rank[0])


def test_single_process_reads_everything_in_sorted_order(tmp_path):
    _fill(str(tmp_path))
    ds = VolumeDataset(str(tmp_path), rank=0, world_size=1)
    assert list(ds) == [f"f{i:02d}".encode() for i in range(N)]
    glob = VolumeDataset(str(tmp_path / "f0[0-2]"), rank=0, world_size=1)
    assert list(glob) == [b"f00", b"f01", b"f02"]
    (tmp_path / ".hidden").write_bytes(b"no")
    assert len(VolumeDataset(str(tmp_path), rank=0, world_size=1).files) == N


def test_set_epoch_reshuffles_reproducibly(source, monkeypatch, tmp_path):
    root, _ = source
    e0 = _epoch(root, 0, 1, monkeypatch, tmp_path, epoch=0)
    e1 = _epoch(root, 0, 1, monkeypatch, tmp_path, epoch=1)
    assert sorted(e0) == sorted(e1) and e0 != e1
    assert _epoch(root, 0, 1, monkeypatch, tmp_path, epoch=1) == e1  # a new instance agrees
    ds = VolumeDataset(root, cache_dir=str(tmp_path / "cache"))
    assert list(ds) == sorted(e0)  # shuffle=False: sorted


def test_decode_many_samples_and_samples_per_rank(tmp_path, monkeypatch):
    for i, k in enumerate([1, 3, 2, 5, 1]):  # files hold different numbers of samples
        (tmp_path / f"f{i}").write_text(",".join(f"{i}.{j}" for j in range(k)))

    def split(data: bytes):
        return iter(data.decode().split(","))

    out = []
    for r in range(2):
        monkeypatch.setenv("RANK", str(r))
        monkeypatch.setenv("WORLD_SIZE", "2")
        ds = VolumeDataset(str(tmp_path), decode=split, samples_per_rank=6)
        assert len(ds) == 6
        out.append(list(ds))
        loaded = [x for b in ds.loader(batch_size=None, num_workers=2) for x in [b]]
        assert len(loaded) == 6
    assert [len(o) for o in out] == [6, 6]
    # A decode returning a list is one sample.
    ds1 = VolumeDataset(str(tmp_path), decode=lambda b: b.decode().split(","), rank=0, world_size=1)
    assert len(list(ds1)) == 5


def test_cache_hits_across_epochs_and_instances(tmp_path):
    root = f"memory://{uuid.uuid4().hex}"
    names = _fill(root)
    ds = VolumeDataset(root, cache_dir=str(tmp_path / "c"), rank=0, world_size=1, shuffle=True)
    assert set(ds) == names
    assert ds.cache is not None and ds.cache.misses == N and ds.cache.hits == 0
    import fsspec

    fsspec.filesystem("memory").rm(root.replace("memory://", "/"), recursive=True)
    ds.set_epoch(1)
    assert set(ds) == names  # the remote is gone: every read is a cache hit
    assert ds.cache.hits == N and ds.cache.misses == N
    # A new dataset over the same files re-uses the cache too (listing kept from ds).
    again = VolumeDataset.__new__(VolumeDataset)
    again.__dict__.update(ds.__dict__)
    again._cache = None
    assert set(again) == names and again.cache is not None and again.cache.hits == N


def test_local_files_are_not_cached_by_default(tmp_path):
    _fill(str(tmp_path / "d"))
    ds = VolumeDataset(str(tmp_path / "d"), cache_dir=str(tmp_path / "c"), rank=0, world_size=1)
    assert ds.cache is None and len(list(ds)) == N


def test_cache_directory_removed_under_a_running_process_is_made_again(tmp_path):
    """A cache whose directory is removed after it was opened (a cleanup job, another run
    emptying it) fills again instead of failing: persistent DataLoader workers keep their
    FileCache for the whole run."""
    import shutil

    cache = FileCache(str(tmp_path / "c"))
    assert cache.get("a", lambda: b"one") == b"one"
    shutil.rmtree(tmp_path / "c")
    assert cache.get("a", lambda: b"two") == b"two"  # refilled: the entry was gone
    shutil.rmtree(tmp_path / "c")

    def write(tmp: str) -> None:
        Path(tmp).write_bytes(b"three")

    path = cache.get_file("b", write)
    assert Path(path).read_bytes() == b"three" and not cache.contains("a")


def test_cache_evicts_least_recently_used(tmp_path):
    cache = FileCache(tmp_path / "c", limit=3500)
    for i in range(3):
        cache.get(f"k{i}", lambda i=i: bytes([i]) * 1000)
    for age, k in enumerate(["k2", "k1", "k0"]):  # all last used minutes ago, k0 first
        os.utime(cache.path(k), (time.time() - 100 - age, time.time() - 100 - age))
    cache.get("k0", lambda: b"never called")  # k0 becomes the most recently used
    assert cache.hits == 1
    cache.get("k3", lambda: b"3" * 1000)  # over the limit: evict down to 90%
    st = cache.stats()
    assert st["bytes"] <= 3500 and st["evictions"] >= 1
    assert os.path.exists(cache.path("k0")) and os.path.exists(cache.path("k3"))
    assert not os.path.exists(cache.path("k1"))
    big = cache.get("huge", lambda: b"h" * 10_000)  # larger than the limit: served, not kept
    assert len(big) == 10_000 and not os.path.exists(cache.path("huge"))
    assert cache.stats()["bytes"] <= 3500


def test_cache_evicts_through_the_dataset(tmp_path):
    root = f"memory://{uuid.uuid4().hex}"
    _fill(root, size=1000)
    ds = VolumeDataset(root, cache_dir=str(tmp_path / "c"), cache_limit=3000, rank=0, world_size=1)
    assert len(list(ds)) == N
    assert ds.cache is not None
    st = ds.cache.stats()
    assert st["bytes"] <= 3000 and st["evictions"] >= N - 3 and st["entries"] <= 3


def _fill_concurrently(cache_dir: str, counter: str, out: str) -> None:
    cache = FileCache(cache_dir, limit=10**6)

    def fetch() -> bytes:
        with open(counter, "a") as f:
            f.write("x")
        time.sleep(0.3)  # a slow download: the others must wait for it, not repeat it
        return b"payload" * 100

    data = cache.get("shared", fetch, size=700)
    with open(out, "wb") as f:
        f.write(data)


def test_concurrent_fills_download_once(tmp_path):
    ctx = multiprocessing.get_context("fork")
    counter = str(tmp_path / "fetches")
    procs = [
        ctx.Process(
            target=_fill_concurrently, args=(str(tmp_path / "c"), counter, str(tmp_path / f"o{i}"))
        )
        for i in range(4)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert Path(counter).read_text() == "x"
    assert {(tmp_path / f"o{i}").read_bytes() for i in range(4)} == {b"payload" * 100}
    assert not [
        n
        for n in os.listdir(os.path.dirname(FileCache(tmp_path / "c").path("shared")))
        if ".tmp-" in n
    ]


def test_concurrent_fills_in_threads_download_once(tmp_path):
    import threading

    cache = FileCache(tmp_path / "c", limit=10**6)
    fetches = []

    def fetch() -> bytes:
        fetches.append(1)
        time.sleep(0.2)
        return b"t" * 500

    out: list[bytes] = []
    threads = [
        threading.Thread(target=lambda: out.append(cache.get("k", fetch, size=500)))
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert out == [b"t" * 500] * 4 and len(fetches) == 1
    assert cache.hits == 3 and cache.misses == 1


def test_cache_counts_and_evicts_entries_of_the_old_layout(tmp_path):
    cache = FileCache(tmp_path / "c", limit=2500)
    old = tmp_path / "c" / "data" / "ab" / ("ab" + "0" * 38)  # data/<key[:2]>/<key>
    old.parent.mkdir()
    old.write_bytes(b"o" * 1000)
    os.utime(old, (time.time() - 100, time.time() - 100))
    assert cache.stats()["entries"] == 1
    cache.get("new1", lambda: b"1" * 1000)
    cache.get("new2", lambda: b"2" * 1000)  # over the limit: the old entry goes first
    assert not old.exists() and cache.stats()["entries"] == 2


def test_resume_mid_epoch_direct(tmp_path):
    _fill(str(tmp_path / "d"), n=9)
    kw = dict(shuffle=True, seed=1, rank=1, world_size=2)
    full = list(VolumeDataset(str(tmp_path / "d"), **kw))
    ds = VolumeDataset(str(tmp_path / "d"), **kw)
    it = iter(ds)
    head = [next(it) for _ in range(2)]
    state = ds.state_dict()
    assert set(state) == {"epoch", "seed", "rank1"}
    again = VolumeDataset(str(tmp_path / "d"), **kw)
    again.load_state_dict(state)
    assert head + list(again) == full
    assert list(again) == full  # the restored position is used once
    again.load_state_dict(state)
    again.set_epoch(1)  # another epoch: the saved position does not apply
    other = VolumeDataset(str(tmp_path / "d"), **kw)
    other.set_epoch(1)
    assert list(again) == list(other) and len(other) == len(full)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_mid_epoch_loader(tmp_path, num_workers):
    _fill(str(tmp_path / "d"), n=13)
    kw = dict(shuffle=True, seed=2, rank=0, world_size=2, decode=lambda b: b.decode())

    def batches(ds):
        return [list(b) for b in ds.loader(batch_size=2, num_workers=num_workers)]

    full = batches(VolumeDataset(str(tmp_path / "d"), **kw))
    ds = VolumeDataset(str(tmp_path / "d"), **kw)
    ds.set_epoch(0)
    got = []
    for b in ds.loader(batch_size=2, num_workers=num_workers):
        got.append(list(b))
        if len(got) == 2:
            break
    again = VolumeDataset(str(tmp_path / "d"), **kw)
    again.load_state_dict(ds.state_dict())
    rest = batches(again)
    assert got + rest == full


def test_state_through_checkpoint_save_load(tmp_path):
    _fill(str(tmp_path / "d"), n=5)
    ds = VolumeDataset(str(tmp_path / "d"), rank=0, world_size=1)
    ds.set_epoch(3)
    it = iter(ds)
    first = next(it)
    checkpoint.save({"data": ds, "step": 4}, str(tmp_path / "ck" / "step-4"))
    assert checkpoint.latest(str(tmp_path / "ck")).endswith("step-4")
    fresh = VolumeDataset(str(tmp_path / "d"), rank=0, world_size=1)
    state = {"data": fresh, "step": 0}
    checkpoint.load(state, checkpoint.latest(str(tmp_path / "ck")))
    assert state["step"] == 4 and fresh.epoch == 3
    assert [first, *fresh] == list(VolumeDataset(str(tmp_path / "d"), rank=0, world_size=1))


def test_checkpoint_without_marker_is_not_latest(tmp_path):
    import torch

    root = tmp_path / "ck"
    checkpoint.save({"w": torch.ones(2)}, str(root / "a-1"))
    checkpoint.save({"w": torch.ones(2) * 2}, str(root / "a-2"))
    (root / "a-2" / checkpoint.MARKER).unlink()  # as if the commit never happened
    (root / "a-3").mkdir()
    assert checkpoint.latest(str(root)).endswith("a-1")
    assert checkpoint.list_checkpoints(str(root)) == [str(root / "a-1")]
    with pytest.raises(checkpoint.IncompleteCheckpointError):
        checkpoint.load({"w": torch.zeros(2)}, str(root / "a-2"))
    assert checkpoint.latest(str(tmp_path / "none")) is None


def test_parse_size():
    assert parse_size("2GiB") == 2 * 2**30 and parse_size("500MB") == 500 * 10**6
    assert parse_size(123) == 123 and parse_size(None) is None
    with pytest.raises(ValueError):
        parse_size("lots")


def test_import_gangrun_stays_light():
    code = "import sys, gangrun, gangrun.checkpoint; print('torch' in sys.modules, 'fsspec' in sys.modules)"
    out = run_python(code)
    assert out.stdout.split() == ["False", "False"], out.stderr


def test_sharding_imports_without_torch_or_fsspec():
    """The partition logic is pure: a fresh interpreter imports it without torch or fsspec,
    and every name the package re-exports is still reachable from ``gangrun.data``."""
    code = (
        "import sys, gangrun.data.sharding as s\n"
        "bad = [m for m in ('torch', 'fsspec') if m in sys.modules]\n"
        "assert not bad, bad\n"
        "assert s.rank_share(s.epoch_order(5, True, 0, 1), 1, 2, 'pad')\n"
        "import gangrun.data as d\n"
        "for name in d.__all__:\n"
        "    getattr(d, name)\n"
        "assert 'torch' in sys.modules\n"
    )
    run_python(code, timeout=120, check=True)


def test_sharding_is_a_partition():
    from gangrun.data import sharding

    for n in range(0, 12):
        for world in (1, 2, 3, 4):
            order = sharding.epoch_order(n, True, 3, 2)
            assert sorted(order) == list(range(n))
            pad = [sharding.rank_share(order, r, world, "pad") for r in range(world)]
            assert len({len(p) for p in pad}) == 1
            assert set().union(*map(set, pad)) == set(range(n))
            drop = [sharding.rank_share(order, r, world, "drop") for r in range(world)]
            assert len({len(p) for p in drop}) == 1 and sum(map(len, drop)) == n - n % world
            for share in pad:
                plans = [sharding.worker_plan(share, w, 3, None)[0] for w in range(3)]
                assert sorted(sum(plans, [])) == sorted(share)


def test_loader_uses_the_public_resume_api(tmp_path):
    """Resume through the public API a custom loader would use: take the position, start
    recording, record the tags of what was received."""
    _fill(str(tmp_path / "d"))
    ds = VolumeDataset(str(tmp_path / "d"), rank=0, world_size=1)
    assert ds.resume_position() is None
    ds.start_progress(1)
    got = []
    for sample, (wid, progress) in ds.iter_tagged():
        got.append(sample)
        ds.record_progress(wid, progress)
        if len(got) == 3:
            break
    state = ds.state_dict()
    again = VolumeDataset(str(tmp_path / "d"), rank=0, world_size=1)
    again.load_state_dict(state)
    start = again.resume_position()
    assert start is not None and start["workers"][0][:2] == [3, 0]  # 3 files done
    rest = [s for s, _ in again.iter_tagged(start)]
    assert sorted(got + rest) == sorted(ds)
    with pytest.raises(RuntimeError, match="start_progress"):
        VolumeDataset(str(tmp_path / "d"), rank=0, world_size=1).record_progress(0, (0, 1, 1))
