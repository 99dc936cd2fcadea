"""The node-local disk cache of remote files (`FileCache`), shared by ranks and workers.

This module does not import torch or fsspec.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import secrets
import shutil
import struct
import time
from collections.abc import Callable, Iterator

from ..wire.contract import CACHE_DIR
from .listing import O_CLOEXEC, read_fd

_OFD_SETLKW: int | None = getattr(fcntl, "F_OFD_SETLKW", None)  # Linux
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


def default_cache_dir() -> str:
    """``$GANGRUN_CACHE_DIR``, else ``~/.cache/gangrun/data`` (shared by all ranks of a node)."""
    env = os.environ.get(CACHE_DIR)
    if env:
        return env
    return os.path.join(os.path.expanduser("~"), ".cache", "gangrun", "data")


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
        self._make_dirs()
        lim = parse_size(limit)
        if lim is None:
            lim = shutil.disk_usage(self.directory).free // 2
        self.limit = int(lim)
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self._touched: dict[str, float] = {}  # key -> when this process last moved its mtime

    def _make_dirs(self) -> None:
        os.makedirs(self._data, exist_ok=True)
        os.makedirs(self._locks, exist_ok=True)

    def _open(self, path: str) -> int:
        """A lock file of the cache, opened read-write (created, and the cache's directories
        made again, when the directory was removed under a running process)."""
        flags = os.O_RDWR | os.O_CREAT | O_CLOEXEC
        try:
            return os.open(path, flags, 0o644)
        except FileNotFoundError:
            self._make_dirs()
            return os.open(path, flags, 0o644)

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
        fd = self._open(os.path.join(self._locks, name))
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
        fd = self._open(self._keylocks)
        try:  # a lock of the open file description: threads with their own fd exclude too
            fcntl.fcntl(fd, _OFD_SETLKW, struct.pack("hhqqi4x", fcntl.F_WRLCK, 0, offset, 1, 0))
            yield
        finally:
            os.close(fd)  # closing releases the lock

    def read_entry(self, key: str, size: int | None) -> bytes | None:
        """The entry's bytes if it is cached whole, else None (the cache-hit path: open, one
        ``read`` of the known size, close; the LRU clock is moved once per 30 s per process)."""
        try:
            fd = os.open(f"{self._data}/{key}", os.O_RDONLY | O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:  # an open file survives a concurrent eviction
            data = read_fd(fd, size)
            if size is not None and len(data) != size:
                return None
            now = time.monotonic()
            if now - self._touched.get(key, -3600.0) > 30:  # the LRU clock, 30 s resolution
                with contextlib.suppress(OSError):  # a read-only cache: LRU order is a hint
                    os.utime(fd)
                self._touched[key] = now
        finally:
            os.close(fd)
        return data

    def contains(self, key: str) -> bool:
        return os.path.exists(self.path(key))

    def get(self, key: str, fetch: Callable[[], bytes], size: int | None = None) -> bytes:
        """The bytes of entry ``key``, calling ``fetch()`` (once per node) to fill it."""
        data = self.read_entry(key, size)
        if data is not None:
            self.hits += 1
            return data
        with self._key_lock(key):
            data = self.read_entry(key, size)
            if data is not None:  # another rank/worker filled it while we waited
                self.hits += 1
                return data
            data = fetch()
            self.misses += 1
            if len(data) <= self.limit:
                self._store(key, data)
        return data

    def get_file(self, key: str, write: Callable[[str], None]) -> str:
        """The path of entry ``key`` on local disk, calling ``write(tmp_path)`` (once per node)
        to fill it: the file is streamed to disk, never held in memory. Open the path at once
        (an open file survives a later eviction; a missing path means: call again)."""
        final = self.path(key)
        if os.path.exists(final):
            self.hits += 1
            now = time.monotonic()
            if now - self._touched.get(key, -3600.0) > 30:  # the LRU clock, 30 s resolution
                with contextlib.suppress(OSError):
                    os.utime(final)
                self._touched[key] = now
            return final
        with self._key_lock(key):
            if os.path.exists(final):  # another rank/worker filled it while we waited
                self.hits += 1
                return final
            tmp = f"{final}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
            self._make_dirs()  # removed since this process made them: a fill makes them again
            try:
                write(tmp)
                self.misses += 1
                self._commit(tmp, final, os.path.getsize(tmp))
            finally:
                with contextlib.suppress(FileNotFoundError):  # renamed into place: nothing left
                    os.unlink(tmp)
        return final

    def _store(self, key: str, data: bytes) -> None:
        final = self.path(key)
        tmp = f"{final}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        self._make_dirs()
        try:
            with open(tmp, "wb", buffering=0) as f:
                f.write(data)
            self._commit(tmp, final, len(data))
        finally:
            with contextlib.suppress(FileNotFoundError):  # renamed into place: nothing left
                os.unlink(tmp)

    def _commit(self, tmp: str, final: str, nbytes: int) -> None:
        """Rename the written ``tmp`` into place as ``final``, evicting first if it would push
        the ledger over the limit."""
        # The global lock file doubles as the ledger: total bytes cached, as text.
        fd = self._open(os.path.join(self._locks, "ledger"))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            raw = os.pread(fd, 32, 0).strip()
            total = int(raw) if raw.isdigit() else None
            if total is None or total + nbytes > self.limit:
                total = self._make_room(nbytes, exclude=final)
            existed = os.path.exists(final)
            os.replace(tmp, final)
            if not existed:
                total += nbytes
            os.pwrite(fd, str(total).ljust(32).encode(), 0)
        finally:
            os.close(fd)

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
                        with contextlib.suppress(OSError):  # another process removed it
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
                with contextlib.suppress(FileNotFoundError):  # evicted by another process
                    os.unlink(path)
                    self.evictions += 1
                total -= size
        return total


__all__ = ["FileCache", "default_cache_dir", "parse_size"]
