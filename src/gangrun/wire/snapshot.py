"""A memory snapshot slot: one rank's copy of its checkpoint state, in a file of the call's
snapshot directory in ``/dev/shm`` (owned by the call's keeper, `gangrun.host.keeper`),
written by the rank and read back by the rank that replaces it after a restart.

Each rank has two slots, ``rank<R>.slot0`` and ``rank<R>.slot1`` (double-buffered: the rank
overwrites the older one, so one complete snapshot always exists). A slot file is::

    [header: HEADER bytes][meta: meta_len bytes][padding to ALIGN][data: data_len bytes]

The header (`SlotHeader`) is the slot's commit marker and its manifest: written last, once
the meta and the data are in place, with the CRC-32 of each and its own CRC-32; the rank
zeroes it before it writes anything else into the slot. A slot whose header is missing,
torn (its own CRC-32 does not match), of another format version, of another rank or world
size, is *not complete*; one whose meta or data do not match their checksums is *damaged*
(`verify`). Neither is ever restored. The data's checksum is the CRC-32 of the CRC-32s of
its 32 MiB chunks (`data_crc`: computed, and verified, on several threads).

What the meta and the data hold (the flattened state dict of one save: the same dict a
storage checkpoint writes) is `gangrun.checkpoint.snapshots`'s.
"""

from __future__ import annotations

import os
import struct
import zlib
from dataclasses import dataclass
from typing import Any

MAGIC = b"GRMEMSL1"
VERSION = 2
CHUNK = 32 << 20  # the data's checksum is over chunks of this size (`data_crc`)
THREADS = 8
HEADER = 4096  # the data starts page-aligned
ALIGN = 64
DIR_PREFIX = "gangrun-mem-"  # /dev/shm/gangrun-mem-<call id>
KEEPER_LOCK = ".keeper"  # flock()ed by the keeper for its whole life
_FMT = "<8sHIIqQIQId"
_SIZE = struct.calcsize(_FMT)


def slot_path(root: str, rank: int, slot: int) -> str:
    return os.path.join(root, f"rank{rank}.slot{slot}")


def data_offset(meta_len: int) -> int:
    """Where the data starts in a slot whose meta is ``meta_len`` bytes."""
    end = HEADER + meta_len
    return (end + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class SlotHeader:
    """A complete slot: whose, which step, and the manifest of its meta and data."""

    rank: int
    world: int
    step: int
    meta_len: int
    meta_crc: int
    data_len: int
    data_crc: int
    time: float

    @property
    def size(self) -> int:
        """Bytes of the slot file this header describes."""
        return data_offset(self.meta_len) + self.data_len

    def to_bytes(self) -> bytes:
        body = struct.pack(
            _FMT,
            MAGIC,
            VERSION,
            self.rank,
            self.world,
            self.step,
            self.meta_len,
            self.meta_crc,
            self.data_len,
            self.data_crc,
            self.time,
        )
        return body + struct.pack("<I", zlib.crc32(body))


def invalidate(buf: Any) -> None:
    """Mark the slot in ``buf`` (a writable buffer, the slot's mmap) not complete: its header
    zeroed (first, before anything else of the slot is overwritten)."""
    buf[: _SIZE + 4] = bytes(_SIZE + 4)


def commit(buf: Any, header: SlotHeader) -> None:
    """Write ``header`` (last: the slot is complete from here on)."""
    raw = header.to_bytes()
    buf[: len(raw)] = raw


def read_header(buf: Any) -> SlotHeader | None:
    """The header of the slot in ``buf``, or None when it is not complete (zeroed, torn,
    another format)."""
    raw = bytes(buf[: _SIZE + 4])
    if len(raw) < _SIZE + 4 or raw[:8] != MAGIC:
        return None
    body, (crc,) = raw[:_SIZE], struct.unpack("<I", raw[_SIZE:])
    if zlib.crc32(body) != crc:
        return None
    magic, version, rank, world, step, mlen, mcrc, dlen, dcrc, t = struct.unpack(_FMT, body)
    if version != VERSION:
        return None
    return SlotHeader(rank, world, step, mlen, mcrc, dlen, dcrc, t)


def crc32(view: Any) -> int:
    """CRC-32 of a buffer (zlib releases the GIL on large buffers)."""
    return zlib.crc32(view) & 0xFFFFFFFF


def data_crc(view: Any) -> int:
    """The data's checksum: the CRC-32 of the CRC-32s of its `CHUNK`-byte chunks, computed
    on up to `THREADS` threads (zlib releases the GIL: a large snapshot is checked at the
    speed of several cores)."""
    mv = memoryview(view).cast("B")
    n = len(mv)
    if n <= CHUNK:
        return crc32(struct.pack("<I", crc32(mv)))
    from concurrent.futures import ThreadPoolExecutor

    parts = [mv[i : i + CHUNK] for i in range(0, n, CHUNK)]
    workers = max(1, min(THREADS, len(parts), os.cpu_count() or 1))
    with ThreadPoolExecutor(workers, thread_name_prefix="gangrun-crc") as pool:
        crcs = list(pool.map(crc32, parts))
    del parts
    return crc32(struct.pack(f"<{len(crcs)}I", *crcs))


def verify(buf: Any, header: SlotHeader) -> str | None:
    """Why the slot in ``buf`` does not hold what ``header`` records (None: it does)."""
    mv = memoryview(buf)
    if len(mv) < header.size:
        return f"holds {len(mv)} bytes, its header records {header.size}"
    meta = mv[HEADER : HEADER + header.meta_len]
    if crc32(meta) != header.meta_crc:
        return "its table of contents does not match its checksum"
    start = data_offset(header.meta_len)
    if data_crc(mv[start : start + header.data_len]) != header.data_crc:
        return f"its {header.data_len} bytes of data do not match their checksum"
    return None


__all__ = [
    "ALIGN",
    "DIR_PREFIX",
    "HEADER",
    "KEEPER_LOCK",
    "MAGIC",
    "SlotHeader",
    "commit",
    "crc32",
    "data_crc",
    "data_offset",
    "invalidate",
    "read_header",
    "slot_path",
    "verify",
]
