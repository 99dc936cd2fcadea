"""VolumeDataset throughput against raw reads of the same files.

    python bench/bench_data.py [--files 300] [--size-kib 128] [--repeat 7]

Measures, for a directory of a few hundred files (medians of ``--repeat`` runs,
raw and dataset alternating, after one untimed warm-up of each):

1. local directory: a VolumeDataset epoch vs ``open().read()`` of every file in order;
2. loopback S3 (moto server in its own process, s3fs client), cold cache: the first
   VolumeDataset epoch (download + cache fill) vs raw ``fs.cat_file`` of every object
   (target >= 0.8x);
3. the same dataset's next epoch, served from the local cache, vs raw sequential reads of
   the same bytes from local files (target >= 0.9x).

Prints samples/s, MB/s and the ratios. Numbers on a shared 2-core machine are noisy.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable

from _common import free_port, start_moto  # also puts src/ on the path


def _compare(
    raw: Callable[[], int],
    dataset: Callable[[], int],
    repeat: int,
    before: Callable[[], None] | None = None,
) -> tuple[float, float, int]:
    """Median seconds of ``raw`` and ``dataset``, run alternately ``repeat`` times each (so both
    see the same machine load and page cache state); ``before`` runs untimed before each
    dataset run. Returns (raw seconds, dataset seconds, bytes)."""
    t_raw: list[float] = []
    t_ds: list[float] = []
    nbytes = 0
    for _ in range(repeat):
        t = time.perf_counter()
        b_raw = raw()
        t_raw.append(time.perf_counter() - t)
        if before is not None:
            before()
        t = time.perf_counter()
        nbytes = dataset()
        t_ds.append(time.perf_counter() - t)
        assert nbytes == b_raw, (nbytes, b_raw)
    return statistics.median(t_raw), statistics.median(t_ds), nbytes


def _timed(fn: Callable[[], int]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _row(name: str, seconds: float, samples: int, nbytes: int) -> None:
    print(
        f"  {name:<34} {seconds * 1e3:8.1f} ms  {samples / seconds:10.0f} samples/s  "
        f"{nbytes / seconds / 1e6:8.1f} MB/s"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", type=int, default=300)
    ap.add_argument("--size-kib", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()

    from gangrun.data import VolumeDataset

    work = tempfile.mkdtemp(prefix="bench-data-")
    local = os.path.join(work, "local")
    os.makedirs(local)
    blob = os.urandom(args.size_kib * 1024)
    for i in range(args.files):
        with open(os.path.join(local, f"part-{i:05d}.bin"), "wb") as f:
            f.write(blob[i % 97 :] + blob[: i % 97])
    paths = sorted(os.path.join(local, n) for n in os.listdir(local))
    n = len(paths)
    print(
        f"{n} files x {args.size_kib} KiB = {n * args.size_kib / 1024:.1f} MiB, median of {args.repeat}, alternating raw and dataset runs"
    )

    def raw_local() -> int:
        total = 0
        for p in paths:
            with open(p, "rb") as f:
                total += len(f.read())
        return total

    sizes = [os.path.getsize(p) for p in paths]  # known from the listing, as in the dataset

    def raw_os_read() -> int:  # the syscalls a cache hit makes: open, one read, close
        total = 0
        for p, size in zip(paths, sizes, strict=True):
            fd = os.open(p, os.O_RDONLY)
            try:
                total += len(os.read(fd, size + 1))
            finally:
                os.close(fd)
        return total

    ds_local = VolumeDataset(local, rank=0, world_size=1)

    def epoch(ds: VolumeDataset) -> Callable[[], int]:
        return lambda: sum(len(s) for s in ds)

    ratios = {}
    print("local directory")
    raw_local(), epoch(ds_local)()  # warm the page cache and the code paths
    t_raw, t_ds, b = _compare(raw_local, epoch(ds_local), args.repeat)
    _row("raw open().read()", t_raw, n, b)
    _row("VolumeDataset epoch", t_ds, n, b)
    ratios["local dataset / raw"] = t_raw / t_ds

    port = free_port()
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    server = start_moto(port)
    try:
        import s3fs

        opts = {"endpoint_url": f"http://127.0.0.1:{port}", "key": "bench", "secret": "bench"}
        fs = s3fs.S3FileSystem(**opts)
        fs.mkdir("bench-data")
        fs.put(local + "/", "bench-data/files/", recursive=True)
        cache_dir = os.path.join(work, "cache")
        ds = VolumeDataset(
            "s3://bench-data/files/",
            storage_options=opts,
            cache_dir=cache_dir,
            rank=0,
            world_size=1,
        )
        assert len(ds.files) == n
        keys = [e.path for e in ds.files]

        def raw_s3() -> int:
            return sum(len(fs.cat_file(k)) for k in keys)

        def clear_cache() -> None:
            shutil.rmtree(cache_dir, ignore_errors=True)
            ds._cache = None
            # Let the disk finish the deletion (and the last run's writes) before the timed
            # run, so that it does not pay for its predecessor's clean-up.
            os.sync()

        print("loopback S3 (moto), first epoch, cold cache")
        raw_s3()  # warm the server and the connection pool
        t_raw_s3, t_cold, b = _compare(raw_s3, epoch(ds), args.repeat, before=clear_cache)
        _row("raw s3fs cat_file, sequential", t_raw_s3, n, b)
        _row("VolumeDataset epoch (fills cache)", t_cold, n, b)
        ratios["S3 first epoch / raw fsspec"] = t_raw_s3 / t_cold

        print("cached epoch")
        epoch(ds)()  # the cache is full from the last cold run; warm its page cache
        t_raw2, t_warm, b = _compare(raw_local, epoch(ds), args.repeat)
        _row("raw open().read() of same bytes", t_raw2, n, b)
        _row("VolumeDataset epoch from cache", t_warm, n, b)
        t_os = statistics.median(_timed(raw_os_read) for _ in range(args.repeat))
        _row("(for reference: raw os.read, 1 call)", t_os, n, b)
        ratios["cached epoch / raw sequential"] = t_raw2 / t_warm
        assert ds.cache is not None and ds.cache.hits >= n
    finally:
        server.kill()
        server.wait(10)
        shutil.rmtree(work, ignore_errors=True)

    print("ratios (throughput of the dataset / throughput of raw reads; higher is better)")
    targets = {"S3 first epoch / raw fsspec": 0.8, "cached epoch / raw sequential": 0.9}
    for k, v in ratios.items():
        tgt = targets.get(k)
        verdict = "" if tgt is None else f"  (target >= {tgt}: {'ok' if v >= tgt else 'MISSED'})"
        print(f"  {k:<32} {v:5.2f}x{verdict}")


if __name__ == "__main__":
    main()
