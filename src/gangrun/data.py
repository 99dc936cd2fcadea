"""Stream files from any storage into training, sharded exactly across ranks and workers.

>>> from gangrun.data import VolumeDataset
>>> ds = VolumeDataset("s3://bucket/shards/", decode=torch.load, shuffle=True)
>>> loader = ds.loader(batch_size=32, num_workers=2)
>>> for epoch in range(start_epoch, epochs):
...     ds.set_epoch(epoch)
...     for batch in loader: ...

What it guarantees (SPEC section 5):

- the files under a local directory, a glob, or any fsspec URL are listed once and sorted, so
  every rank and every DataLoader worker sees the same list;
- each epoch every file is read exactly once, split across ranks (``RANK``/``WORLD_SIZE``) and
  across the DataLoader workers of each rank;
- every rank yields the same number of files per epoch: ``uneven="pad"`` (default) repeats a
  few files so that no file is skipped, ``uneven="drop"`` leaves out the last ``n % world_size``
  files of the epoch's order. When ``decode`` turns one file into several samples the counts
  are only equal if every file holds as many samples; pass ``samples_per_rank=N`` to make every
  rank yield exactly ``N`` samples whatever the files hold;
- ``set_epoch(e)`` reshuffles (``shuffle=True``) with a permutation that depends only on
  ``seed`` and ``e``;
- remote files (anything but the local filesystem) are cached on local disk, bounded by
  ``cache_limit`` bytes with least-recently-used eviction, filled atomically (temporary name,
  then rename) under a per-file lock, so ranks and workers that want the same file download it
  once; the cache is re-used across epochs, calls and processes;
- ``state_dict()``/``load_state_dict()`` record how far each rank got, so a restarted gang
  continues in the middle of an epoch (iterate the dataset directly or through
  :meth:`VolumeDataset.loader`; a plain ``DataLoader`` with workers cannot report progress).

``import gangrun`` does not import this module; importing it imports torch (the dataset is a
``torch.utils.data.IterableDataset``), fsspec is imported when files are listed.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import random
import re
import secrets
import shutil
import struct
import time
import types
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

from torch.utils.data import DataLoader, IterableDataset

__all__ = ["VolumeDataset", "VolumeLoader", "FileCache", "FileEntry", "default_cache_dir"]

_GLOB_CHARS = re.compile(r"[*?\[]")
_LOCAL_PROTOCOLS = ("file", "local")
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_UNITS.update({"ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40})


def parse_size(value: int | str | None) -> int | None:
    """``10_000``, ``"500MB"``, ``"2GiB"`` -> bytes; ``None`` stays ``None``."""
    if value is None or isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kKmMgGtT]?i?)[bB]?\s*", str(value))
    if not m:
        raise ValueError(f"cannot read a size from {value!r} (use bytes or e.g. '500MB', '2GiB')")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_OFD_SETLKW: int | None = getattr(fcntl, "F_OFD_SETLKW", None)  # Linux


def _read_fd(fd: int, size: int | None) -> bytes:
    """The rest of open file ``fd``; with its expected ``size``, in one ``read`` call (asking
    for one byte more, so a longer file is noticed without another call)."""
    if not size:
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    data = os.read(fd, size + 1)
    if len(data) < size:  # reads stop at ~2 GiB, or the file is shorter than listed
        chunks = [data]
        got = len(data)
        while got <= size and (chunk := os.read(fd, size + 1 - got)):
            chunks.append(chunk)
            got += len(chunk)
        data = b"".join(chunks)
    return data


def _read_local(entry: FileEntry) -> bytes:
    """A local file's bytes, in one ``read`` call when its size is as listed."""
    fd = os.open(entry.path, os.O_RDONLY | _O_CLOEXEC)
    try:
        data = _read_fd(fd, entry.size)
        if len(data) > entry.size:  # grew since it was listed
            data += _read_fd(fd, None)
    finally:
        os.close(fd)
    return data


def default_cache_dir() -> str:
    """``$GANGRUN_CACHE_DIR``, else ``~/.cache/gangrun/data`` (shared by all ranks of a node)."""
    env = os.environ.get("GANGRUN_CACHE_DIR")
    if env:
        return env
    return os.path.join(os.path.expanduser("~"), ".cache", "gangrun", "data")


@dataclass(frozen=True)
class FileEntry:
    """One listed file: its path on the filesystem, size and a version tag (ETag/mtime)."""

    path: str
    size: int
    version: str


# --------------------------------------------------------------------------------------------
# Local disk cache
# --------------------------------------------------------------------------------------------


class FileCache:
    """A directory of cached files shared by every process of a node.

    Entries are content-addressed by (protocol, path, size, version), so a changed remote file
    is a new entry; they lie flat in ``data/``. A hit is open, one ``read`` of the known size,
    close; each process moves an entry's mtime (the LRU clock) at most once per 30 s. A miss
    takes an exclusive lock on that entry (Linux: a byte-range lock in one shared file, so no
    lock file is created per entry; elsewhere a ``flock`` file per entry), checks again
    (another process or thread may have filled it meanwhile), downloads, writes a temporary
    file and renames it into place, so readers never see a partial file. The total size is
    kept in a small ledger updated under a global lock;
    when an entry would push it over ``limit`` the least recently used entries are evicted down
    to 90% of the limit (a full rescan, which also corrects the ledger). A file larger than the
    limit is returned but not kept.
    """

    def __init__(
        self, directory: str | os.PathLike[str] | None = None, limit: int | str | None = None
    ):
        self.directory = os.path.abspath(os.fspath(directory or default_cache_dir()))
        self._data = os.path.join(self.directory, "data")
        self._locks = os.path.join(self.directory, "locks")
        self._keylocks = os.path.join(self._locks, "entries")
        os.makedirs(self._data, exist_ok=True)
        os.makedirs(self._locks, exist_ok=True)
        lim = parse_size(limit)
        if lim is None:
            lim = shutil.disk_usage(self.directory).free // 2
        self.limit = int(lim)
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self._touched: dict[str, float] = {}  # key -> when this process last moved its mtime

    @staticmethod
    def key(*parts: object) -> str:
        return hashlib.sha256("\0".join(map(str, parts)).encode()).hexdigest()[:40]

    def path(self, key: str) -> str:
        return os.path.join(self._data, key)

    def stats(self) -> dict[str, int]:
        """This process's counters, plus the bytes and entries on disk now."""
        entries = list(self._entries())
        return {
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
            "entries": len(entries),
            "bytes": sum(size for _, size, _ in entries),
        }

    @contextlib.contextmanager
    def _flock(self, name: str) -> Iterator[None]:
        fd = os.open(os.path.join(self._locks, name), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the lock

    @contextlib.contextmanager
    def _key_lock(self, key: str) -> Iterator[None]:
        """Exclusive, across processes and threads, for filling entry ``key``.

        On Linux: a one-byte open-file-description lock at an offset hashed from the key, in
        one shared file (no file is created per entry: creating files is the slow part of a
        fill on some disks). Elsewhere: ``flock`` on a lock file per entry.
        """
        if _OFD_SETLKW is None:
            with self._flock(key + ".lock"):
                yield
            return
        offset = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=7).digest(), "big")
        fd = os.open(self._keylocks, os.O_RDWR | os.O_CREAT | _O_CLOEXEC, 0o644)
        try:  # a lock of the open file description: threads with their own fd exclude too
            fcntl.fcntl(fd, _OFD_SETLKW, struct.pack("hhqqi4x", fcntl.F_WRLCK, 0, offset, 1, 0))
            yield
        finally:
            os.close(fd)  # closing releases the lock

    def _read_entry(self, key: str, size: int | None) -> bytes | None:
        """The entry's bytes if it is cached whole, else None (the cache-hit path: open, one
        ``read`` of the known size, close; the LRU clock is moved once per 30 s per process)."""
        try:
            fd = os.open(f"{self._data}/{key}", os.O_RDONLY | _O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:  # an open file survives a concurrent eviction
            data = _read_fd(fd, size)
            if size is not None and len(data) != size:
                return None
            now = time.monotonic()
            if now - self._touched.get(key, -3600.0) > 30:  # the LRU clock, 30 s resolution
                with contextlib.suppress(OSError):
                    os.utime(fd)
                self._touched[key] = now
        finally:
            os.close(fd)
        return data

    def contains(self, key: str) -> bool:
        return os.path.exists(self.path(key))

    def get(self, key: str, fetch: Callable[[], bytes], size: int | None = None) -> bytes:
        """The bytes of entry ``key``, calling ``fetch()`` (once per node) to fill it."""
        data = self._read_entry(key, size)
        if data is not None:
            self.hits += 1
            return data
        with self._key_lock(key):
            data = self._read_entry(key, size)
            if data is not None:  # another rank/worker filled it while we waited
                self.hits += 1
                return data
            data = fetch()
            self.misses += 1
            if len(data) <= self.limit:
                self._store(key, data)
        return data

    def _store(self, key: str, data: bytes) -> None:
        final = self.path(key)
        tmp = f"{final}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            with open(tmp, "wb", buffering=0) as f:
                f.write(data)
            # The global lock file doubles as the ledger: total bytes cached, as text.
            fd = os.open(os.path.join(self._locks, "ledger"), os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                raw = os.pread(fd, 32, 0).strip()
                total = int(raw) if raw.isdigit() else None
                if total is None or total + len(data) > self.limit:
                    total = self._make_room(len(data), exclude=final)
                existed = os.path.exists(final)
                os.replace(tmp, final)
                if not existed:
                    total += len(data)
                os.pwrite(fd, str(total).ljust(32).encode(), 0)
            finally:
                os.close(fd)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def _entries(self) -> Iterator[tuple[str, int, float]]:
        now = time.time()
        # Entries lie flat in data/ (one directory: creating many small directories is slow
        # on some disks); entries in subdirectories, from older versions, are counted and
        # evicted like the others.
        legacy = [sub.path for sub in os.scandir(self._data) if sub.is_dir()]
        for folder in [self._data, *legacy]:
            for e in os.scandir(folder):
                if e.is_dir():
                    continue
                try:
                    st = e.stat()
                except FileNotFoundError:
                    continue
                if ".tmp-" in e.name:
                    if now - st.st_mtime > 3600:  # left by a killed process
                        with contextlib.suppress(OSError):
                            os.unlink(e.path)
                    continue
                yield e.path, st.st_size, st.st_mtime

    def _make_room(self, incoming: int, exclude: str) -> int:
        """Rescan the cache, evict LRU entries down to 90% of the limit; the bytes left."""
        entries = sorted(self._entries(), key=lambda e: e[2])
        total = sum(s for _, s, _ in entries)
        if total + incoming > self.limit:
            target = max(0, int(self.limit * 0.9) - incoming)
            for path, size, _ in entries:
                if total <= target:
                    break
                if path == exclude:
                    continue
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                    self.evictions += 1
                total -= size
        return total


# --------------------------------------------------------------------------------------------
# Listing
# --------------------------------------------------------------------------------------------


def _version(info: dict[str, Any]) -> str:
    for k in ("ETag", "etag", "md5Hash", "mtime", "LastModified", "last_modified", "created"):
        v = info.get(k)
        if v is not None:
            return str(v)
    return ""


def _list_files(source: Any, storage_options: dict[str, Any]) -> tuple[str, list[FileEntry], Any]:
    from fsspec.core import url_to_fs

    sources = list(source) if isinstance(source, (list, tuple)) else [source]
    if not sources:
        raise ValueError("VolumeDataset needs a directory, glob, URL or list of files")
    protocol = None
    found: dict[str, dict[str, Any]] = {}
    fs: Any = None
    for src in sources:
        fs, path = url_to_fs(os.fspath(src), **storage_options)
        fs.invalidate_cache()  # a listing cached earlier in this process may be stale
        proto = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
        if protocol is None:
            protocol = proto
        elif proto != protocol:
            raise ValueError(f"all sources must be on one filesystem, got {protocol} and {proto}")
        if _GLOB_CHARS.search(path):
            infos = fs.glob(path, detail=True)
        elif fs.isdir(path):
            infos = fs.find(path, detail=True)
        elif fs.exists(path):
            infos = {path: fs.info(path)}
        else:
            raise FileNotFoundError(f"VolumeDataset: nothing found at {src!r}")
        for p, info in infos.items():
            if info.get("type", "file") != "file":
                continue
            if os.path.basename(p.rstrip("/")).startswith("."):
                continue  # hidden files: .DS_Store, partial uploads, ...
            found[p] = info
    entries = [
        FileEntry(p, int(found[p].get("size") or 0), _version(found[p])) for p in sorted(found)
    ]
    return str(protocol), entries, fs


# --------------------------------------------------------------------------------------------
# The dataset
# --------------------------------------------------------------------------------------------


def _env_int(name: str, default: int) -> int:
    v = os.environ.get(name)
    return int(v) if v not in (None, "") else default


class VolumeDataset(IterableDataset):
    """An iterable dataset over the files under ``source`` (see the module docstring).

    Args:
        source: local directory or file, glob (``"data/*.pt"``), fsspec URL (``"s3://b/p/"``,
            ``"memory://x"``, ...) or a list of them on one filesystem.
        decode: ``decode(data: bytes)`` -> one sample, or an *iterator* (e.g. a generator or
            ``iter(list)``) of samples. Lists, tuples, tensors, dicts are one sample each.
            Default: the file's bytes are the sample.
        shuffle: shuffle the file order every epoch (same permutation on every rank).
        seed: seed of the shuffle; epoch ``e`` uses ``(seed, e)``.
        cache_dir: where remote files are cached (default :func:`default_cache_dir`).
        cache_limit: cache size bound in bytes (or ``"20GB"``); default half the free space.
        cache: ``"auto"`` (default: cache everything that is not on the local filesystem),
            ``True`` or ``False``.
        uneven: ``"pad"`` (default; repeat files from the start of the epoch's order so every
            rank gets ``ceil(n / world_size)`` files and none is skipped) or ``"drop"`` (every
            rank gets ``n // world_size`` files; the rest of the epoch's order is not read).
        samples_per_rank: yield exactly this many samples per rank and epoch (split across
            workers), cycling over the rank's files if they hold fewer. Use it when files
            decode to different numbers of samples.
        prefetch: files read ahead by a background thread in each worker (default: 4 for
            remote, 0 for local files).
        rank, world_size: override ``RANK``/``WORLD_SIZE`` (otherwise from the environment
            that gangrun or torchrun sets; 0 and 1 when unset).
        storage_options: passed to fsspec (e.g. ``{"endpoint_url": ...}`` for s3).
    """

    def __init__(
        self,
        source: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        *,
        decode: Callable[[bytes], Any] | None = None,
        shuffle: bool = False,
        seed: int = 0,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_limit: int | str | None = None,
        cache: bool | Literal["auto"] = "auto",
        uneven: Literal["pad", "drop"] = "pad",
        samples_per_rank: int | None = None,
        prefetch: int | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if uneven not in ("pad", "drop"):
            raise ValueError(f"uneven must be 'pad' or 'drop', got {uneven!r}")
        if samples_per_rank is not None and samples_per_rank < 0:
            raise ValueError("samples_per_rank must be >= 0")
        self.source = source
        self.decode = decode
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.uneven = uneven
        self.samples_per_rank = samples_per_rank
        self.storage_options = dict(storage_options or {})
        self._rank = rank
        self._world_size = world_size
        self.protocol, self.files, _ = _list_files(source, self.storage_options)
        remote = self.protocol not in _LOCAL_PROTOCOLS
        self.cached = remote if cache == "auto" else bool(cache)
        self.prefetch = (4 if remote else 0) if prefetch is None else int(prefetch)
        self._cache_dir = os.fspath(cache_dir) if cache_dir is not None else None
        self._cache_limit = parse_size(cache_limit)
        self._cache: FileCache | None = None
        self._cache_pid = -1
        self._fs: Any = None
        self._fs_pid = -1
        self._keys: dict[str, str] = {}
        self._epoch = 0
        self._resume: dict[str, Any] | None = None  # applied once, by the next iteration
        self._live: dict[str, Any] | None = None  # progress of the current/last iteration

    # -- partitioning --------------------------------------------------------------------------

    def rank_world(self) -> tuple[int, int]:
        rank = self._rank if self._rank is not None else _env_int("RANK", 0)
        world = self._world_size if self._world_size is not None else _env_int("WORLD_SIZE", 1)
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is outside world size {world}")
        return rank, world

    @property
    def epoch(self) -> int:
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Use epoch ``epoch``'s order; a different epoch than the restored one starts afresh."""
        epoch = int(epoch)
        if epoch != self._epoch:
            self._resume = None
            self._live = None
        self._epoch = epoch

    def epoch_order(self, epoch: int | None = None) -> list[int]:
        """Indexes into :attr:`files` in the order of ``epoch`` (same on every rank)."""
        order = list(range(len(self.files)))
        if self.shuffle:
            random.Random(f"gangrun:{self.seed}:{self._epoch if epoch is None else epoch}").shuffle(
                order
            )
        return order

    def rank_files(self, epoch: int | None = None, rank: int | None = None) -> list[FileEntry]:
        """The files rank ``rank`` reads in ``epoch`` (padded or dropped to equal counts)."""
        r, world = self.rank_world()
        r = r if rank is None else rank
        order = self.epoch_order(epoch)
        n = len(order)
        if self.uneven == "drop":
            order = order[: (n // world) * world]
        elif n:
            need = -(-n // world) * world - n
            order = order + [order[i % n] for i in range(need)]
        return [self.files[i] for i in order[r::world]]

    def _worker_plan(self, rank_files: list[FileEntry], wid: int, nw: int):
        files = rank_files[wid::nw]
        quota = None
        if self.samples_per_rank is not None:
            q = self.samples_per_rank
            quota = q // nw + (1 if wid < q % nw else 0)
            if not files and quota:
                files = (
                    rank_files[wid % len(rank_files) :] + rank_files[: wid % len(rank_files)]
                    if rank_files
                    else []
                )
        return files, quota

    def __len__(self) -> int:
        """Samples per rank and epoch: ``samples_per_rank``, else files per rank (exact when
        every file decodes to one sample)."""
        if self.samples_per_rank is not None:
            return self.samples_per_rank
        return len(self.rank_files())

    # -- reading -------------------------------------------------------------------------------

    def _filesystem(self) -> Any:
        if self._fs is None or self._fs_pid != os.getpid():
            import fsspec

            self._fs = fsspec.filesystem(self.protocol, **self.storage_options)
            self._fs_pid = os.getpid()
        return self._fs

    def _file_cache(self) -> FileCache:
        if self._cache is None or self._cache_pid != os.getpid():
            self._cache = FileCache(self._cache_dir, self._cache_limit)
            self._cache_pid = os.getpid()
        return self._cache

    @property
    def cache(self) -> FileCache | None:
        """This process's view of the cache (``None`` when files are not cached)."""
        return self._file_cache() if self.cached else None

    def _key(self, entry: FileEntry) -> str:
        key = self._keys.get(entry.path)
        if key is None:
            key = self._keys[entry.path] = FileCache.key(
                self.protocol, entry.path, entry.size, entry.version
            )
        return key

    def read(self, entry: FileEntry) -> bytes:
        """The bytes of one listed file (through the cache for remote files)."""
        if self.protocol in _LOCAL_PROTOCOLS and not self.cached:
            return _read_local(entry)
        fs = self._filesystem()
        if not self.cached:
            return bytes(fs.cat_file(entry.path))
        return self._file_cache().get(
            self._key(entry), lambda: bytes(fs.cat_file(entry.path)), entry.size
        )

    def _hit_reader(self) -> Callable[[FileEntry], bytes | None] | None:
        """``f(entry)`` -> the bytes if they are at hand (local file or cache hit), else None;
        None when nothing is ever at hand (uncached remote files)."""
        if not self.cached:
            return _read_local if self.protocol in _LOCAL_PROTOCOLS else None
        cache = self._file_cache()
        read_entry = cache._read_entry
        key = self._key

        def hit(entry: FileEntry) -> bytes | None:
            data = read_entry(key(entry), entry.size)
            if data is not None:
                cache.hits += 1
            return data

        return hit

    def _decoded(self, data: bytes) -> Iterable[Any]:
        if self.decode is None:
            return (data,)
        out = self.decode(data)
        if isinstance(out, (Iterator, types.GeneratorType)):
            return out
        return (out,)

    def _stream(
        self, files: list[FileEntry], quota: int | None, start: Sequence[int] | None
    ) -> Iterator[tuple[Any, tuple[int, int, int]]]:
        """(sample, progress) pairs; progress = (file position, samples of it done, yielded)."""
        fpos, skip, yielded = (list(start) + [0, 0, 0])[:3] if start else (0, 0, 0)
        if quota is not None and yielded >= quota:
            return
        if not files:
            if quota:
                raise ValueError("samples_per_rank > 0 but this rank has no files to read")
            return
        n = len(files)
        limit = n if quota is None else None
        hit = self._hit_reader()
        read = self.read
        decode = self.decode
        prefetch = self.prefetch
        pool = (
            ThreadPoolExecutor(min(prefetch, 16), thread_name_prefix="gangrun-prefetch")
            if prefetch and hit is not _read_local
            else None
        )
        ahead: dict[int, Future[bytes]] = {}
        empty_run = 0
        try:
            while limit is None or fpos < limit:
                # Files at hand (cache hits, local files) are read inline; after a miss the
                # next `prefetch` files are fetched in the background, several at a time,
                # and the window is kept full until hits resume.
                fut = ahead.pop(fpos, None) if ahead else None
                if fut is not None:
                    data: bytes | None = fut.result()
                else:
                    data = hit(files[fpos % n]) if hit is not None else None
                if pool is not None and (fut is not None or data is None):
                    last = fpos + prefetch if limit is None else min(fpos + prefetch, limit - 1)
                    for i in range(fpos + 1, last + 1):
                        if i not in ahead:
                            ahead[i] = pool.submit(read, files[i % n])
                if data is None:
                    data = read(files[fpos % n])
                if decode is None and not skip:  # the common case, without a per-sample loop
                    k = 1
                    yielded += 1
                    yield data, (fpos, 1, yielded)
                    if quota is not None and yielded >= quota:
                        return
                else:
                    k = 0
                    for sample in self._decoded(data):
                        k += 1
                        if k <= skip:
                            continue
                        yielded += 1
                        yield sample, (fpos, k, yielded)
                        if quota is not None and yielded >= quota:
                            return
                empty_run = empty_run + 1 if k == 0 else 0
                if quota is not None and empty_run > n:
                    raise ValueError("samples_per_rank: none of this rank's files holds a sample")
                fpos += 1
                skip = 0
        finally:
            if pool is not None:
                for pending in ahead.values():
                    pending.cancel()
                pool.shutdown(wait=False)

    def _iterate(self, start: dict[str, Any] | None, tagged: bool) -> Iterator[Any]:
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        rank, world = self.rank_world()
        files, quota = self._worker_plan(self.rank_files(rank=rank), wid, nw)
        wstart = None
        if start is not None:
            if start.get("num_workers") == nw and start.get("world_size") == world:
                wstart = start["workers"][wid]
            elif wid == 0:
                warnings.warn(
                    f"VolumeDataset: the saved position was made with world_size="
                    f"{start.get('world_size')} and {start.get('num_workers')} worker(s), not "
                    f"{world} and {nw}; epoch {self._epoch} restarts from its beginning.",
                    stacklevel=3,
                )
        track = info is None and not tagged  # direct iteration in this process
        if track:
            self._live = self._progress_template(world, 1, start if wstart else None)
        stream = self._stream(files, quota, wstart)
        if tagged:
            for sample, progress in stream:
                yield sample, (wid, progress)
        elif track:
            workers = self._live["workers"]  # type: ignore[index]
            for sample, progress in stream:
                workers[0] = progress  # a tuple; state_dict() stores it as a JSON list
                yield sample
        else:
            for sample, _ in stream:
                yield sample

    def _progress_template(
        self, world: int, nw: int, start: dict[str, Any] | None
    ) -> dict[str, Any]:
        if start is not None:
            return json.loads(json.dumps(start))
        return {
            "epoch": self._epoch,
            "world_size": world,
            "num_workers": nw,
            "files": len(self.files),
            "seed": self.seed,
            "workers": [None] * nw,
        }

    def _take_resume(self) -> dict[str, Any] | None:
        start, self._resume = self._resume, None
        if start is None:
            return None
        if start.get("epoch") != self._epoch or start.get("files") != len(self.files):
            warnings.warn(
                "VolumeDataset: the saved position does not match this dataset (epoch or file "
                "count changed); the epoch restarts from its beginning.",
                stacklevel=3,
            )
            return None
        return start

    def __iter__(self) -> Iterator[Any]:
        from torch.utils.data import get_worker_info

        start = self._take_resume() if get_worker_info() is None else self._resume
        return self._iterate(start, tagged=False)

    # -- resumable state -----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """``{"epoch", "seed", "rank<R>": <json of this rank's progress>}``.

        The rank's progress lives under its own key so that ``torch.distributed.checkpoint``
        (which keeps one copy of keys shared by ranks) stores every rank's position; the
        dataset is ``Stateful``, so ``gangrun.checkpoint.save({"data": ds, ...}, url)`` works.
        """
        rank, _ = self.rank_world()
        progress = self._live if self._live is not None else self._resume
        return {
            "epoch": self._epoch,
            "seed": self.seed,
            f"rank{rank}": json.dumps(progress),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; the next iteration continues where this rank stopped."""
        rank, _ = self.rank_world()
        self._epoch = int(state["epoch"])
        self._live = None
        raw = state.get(f"rank{rank}")
        progress = json.loads(raw) if isinstance(raw, (str, bytes)) else raw
        if progress is not None and (
            progress.get("epoch") != self._epoch or progress.get("seed") != self.seed
        ):
            progress = None
        self._resume = progress

    # -- DataLoader ----------------------------------------------------------------------------

    def loader(self, **dataloader_kwargs: Any) -> VolumeLoader:
        """A ``DataLoader`` over this dataset that keeps :meth:`state_dict` exact with workers."""
        return VolumeLoader(self, **dataloader_kwargs)

    def __repr__(self) -> str:
        return (
            f"VolumeDataset({self.source!r}, files={len(self.files)}, shuffle={self.shuffle}, "
            f"uneven={self.uneven!r}, cached={self.cached})"
        )


class _TaggedView(IterableDataset):
    """What the loader's workers iterate: samples tagged with (worker id, progress)."""

    def __init__(self, volume: VolumeDataset) -> None:
        self.volume = volume
        self.start: dict[str, Any] | None = None

    def __iter__(self) -> Iterator[Any]:
        return self.volume._iterate(self.start, tagged=True)


class _Collate:
    def __init__(self, inner: Callable[[Any], Any] | None, batched: bool) -> None:
        self.inner = inner
        self.batched = batched

    def __call__(self, items: Any) -> Any:
        from torch.utils.data import default_collate, default_convert

        if self.batched:
            samples = [s for s, _ in items]
            return (self.inner or default_collate)(samples), items[-1][1]
        sample, tag = items
        return (self.inner or default_convert)(sample), tag


class VolumeLoader(DataLoader):
    """``DataLoader`` for a :class:`VolumeDataset` that reports the rank's exact progress.

    Takes the usual ``DataLoader`` arguments (``batch_size``, ``num_workers``, ``collate_fn``,
    ``pin_memory``, ...) except ``persistent_workers`` (workers must see each epoch's order).
    Every batch carries, from its worker, how far that worker got; the loader records it in
    the dataset as the batch is handed out, so ``dataset.state_dict()`` counts exactly the
    batches the training loop received.
    """

    def __init__(self, dataset: VolumeDataset, **kwargs: Any) -> None:
        if kwargs.get("persistent_workers"):
            raise ValueError("VolumeLoader does not support persistent_workers=True")
        if "sampler" in kwargs or "batch_sampler" in kwargs or kwargs.get("shuffle"):
            raise ValueError("VolumeDataset does its own sharding and shuffling")
        self.volume = dataset
        self._view = _TaggedView(dataset)
        kwargs["collate_fn"] = _Collate(
            kwargs.get("collate_fn"), kwargs.get("batch_size", 1) is not None
        )
        super().__init__(self._view, **kwargs)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        ds = self.volume
        nw = max(1, int(self.num_workers))
        start = ds._take_resume()
        self._view.start = start
        _, world = ds.rank_world()
        same = start is not None and (start["num_workers"], start["world_size"]) == (nw, world)
        live = ds._progress_template(world, nw, start if same else None)
        ds._live = live
        for batch, (wid, progress) in super().__iter__():
            live["workers"][wid] = list(progress)
            yield batch
