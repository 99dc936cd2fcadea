"""``collectives.<rank>``: where a rank is in its ``torch.distributed`` calls, as a small ring
of fixed-size slots in a memory-mapped file. The rank writes (`Ring`, from
`gangrun.rank.collectives`); the caller reads (`read`) at any moment, also while the rank is
stuck inside a collective, which is the point.

Layout (little-endian): a `HEADER` (magic, rank, pid, slot count) then
`SLOTS` slots of `SLOT` bytes. Each slot holds one `OpRecord`: op name, process group, the
group's sequence number, peer (point-to-point), element count, shapes and dtypes, the call
site in user code (``file:line``), entered and left times (``left`` 0: still inside).

A slot is guarded like a seqlock: its first 8 bytes are odd while the rank writes it and even
once written; a reader copies the slot between two reads of that counter and keeps it only
when both are the same even number, so a torn read is dropped, never misread. ``left`` is one
aligned 8-byte store made when the op returns.
"""

from __future__ import annotations

import functools
import mmap
import os
import struct
from dataclasses import dataclass

from .rundir import RunDir

MAGIC = b"GRCOLL1\0"
SLOTS = 64
_HEADER = struct.Struct("<8siiIxxxx")  # magic, rank, pid, slots
HEADER = _HEADER.size
# counter, entered, left, seq, numel, peer, op, group, shapes, site
_SLOT = struct.Struct("<Qddqqi20s28s40s116s")
SLOT = _SLOT.size
_LEFT_AT = LEFT_AT = 16
_BUSY = struct.Struct("<Qddq")  # counter, entered, left, seq: what changes between calls
_STATIC = struct.Struct("<qi20s28s40s116s")  # numel, peer, op, group, shapes, site
_STATIC_AT = _BUSY.size
SIZE = HEADER + SLOTS * SLOT
_COUNTER = struct.Struct("<Q")
_TIME = struct.Struct("<d")

# Ops that are not collectives: a region of user code that may communicate (DDP's and FSDP's
# collectives run from C++ autograd hooks inside backward(), which Python cannot see).
REGIONS = frozenset({"backward", "DDP forward"})


@dataclass(frozen=True)
class OpRecord:
    """One ``torch.distributed`` call of a rank (or a region that may communicate)."""

    op: str  # "all_reduce", "init_process_group", "backward", ...
    group: str  # "world", or the group's ranks "0,2"
    seq: int  # this op's number on its group (init_process_group is number 0 of "world")
    peer: int  # point-to-point: the other rank (-1: none, or any)
    numel: int  # elements of the op's tensor (-1: none)
    shapes: str  # e.g. "float32[4, 4]" ("": none)
    site: str  # the call site in user code, "path:line"
    entered: float  # wall clock
    left: float  # wall clock; 0.0 while still inside

    @property
    def inside(self) -> bool:
        return self.left == 0.0

    @property
    def region(self) -> bool:
        return self.op in REGIONS

    def to_bytes(self) -> bytes:
        """The slot's part that one call site repeats (all but the times and the sequence
        number): the rank keeps it per call site (`Ring.write`)."""
        return static_bytes(self.op, self.group, self.peer, self.numel, self.shapes, self.site)


def static_bytes(op: str, group: str, peer: int, numel: int, shapes: str, site: str) -> bytes:
    return _STATIC.pack(
        numel, peer, _text(op, 20), _text(group, 28), _text(shapes, 40),
        _text(site, 116, keep_end=True),
    )  # fmt: skip


@dataclass(frozen=True)
class RingView:
    """What the caller read of one rank's ring: its records, oldest first."""

    rank: int
    pid: int
    written: int  # records ever written (the ring keeps the last `SLOTS`), as far as seen
    records: tuple[OpRecord, ...]

    @property
    def current(self) -> OpRecord | None:
        """The op the rank is inside now (the innermost one), if any."""
        for rec in reversed(self.records):
            if rec.inside:
                return rec
        return None

    def find(self, group: str, seq: int) -> OpRecord | None:
        """The collective #``seq`` on ``group``, if the ring still holds it."""
        for rec in reversed(self.records):
            if rec.group == group and rec.seq == seq and not rec.region and rec.peer < 0:
                return rec
        return None

    def last_on(self, group: str) -> OpRecord | None:
        """The latest collective on ``group`` (regions and point-to-point ops excluded)."""
        for rec in reversed(self.records):
            if rec.group == group and not rec.region and rec.peer < 0:
                return rec
        return None


def _text(s: str, n: int, keep_end: bool = False) -> bytes:
    b = s.encode("utf-8", "replace")
    if len(b) > n:
        b = b[-n:] if keep_end else b[:n]
    return b


def _untext(b: bytes) -> str:
    return b.rstrip(b"\0").decode("utf-8", "replace")


def path(run_dir: str, rank: int) -> str:
    return RunDir(run_dir).collectives(rank)


class Ring:
    """The rank's writer: `open` maps the file; `enter` writes a record and returns its slot,
    `leave` stamps the slot's ``left`` time."""

    def __init__(self, mm: mmap.mmap) -> None:
        self._mm = mm
        self._written = 0
        # the hot path's "left" stamp: stamp(slot offset + LEFT_AT, time), one C call
        self.stamp = functools.partial(_TIME.pack_into, mm)

    @classmethod
    def open(cls, file: str, rank: int) -> Ring:
        """Create the rank's file (0600) and map it. Raises ``OSError``."""
        fd = os.open(file, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, SIZE)
            mm = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)
        _HEADER.pack_into(mm, 0, MAGIC, rank, os.getpid(), SLOTS)
        return cls(mm)

    def enter(self, rec: OpRecord) -> int:
        """Write ``rec`` into the next slot; the slot's offset (for `leave`)."""
        off = self.write(rec.to_bytes(), rec.seq, rec.entered)
        if not rec.inside:
            self.leave(off, rec.left)
        return off

    def write(self, static: bytes, seq: int, entered: float) -> int:
        """The hot path: a record from its call site's `static_bytes`; the slot's offset."""
        n = self._written = self._written + 1
        off = HEADER + (n - 1) % SLOTS * SLOT
        mm = self._mm
        _BUSY.pack_into(mm, off, 2 * n - 1, entered, 0.0, seq)  # the counter first: busy
        mm[off + _STATIC_AT : off + SLOT] = static
        _COUNTER.pack_into(mm, off, 2 * n)  # complete
        return off

    def leave(self, off: int, when: float) -> None:
        _TIME.pack_into(self._mm, off + _LEFT_AT, when)


def read(run_dir: str, rank: int) -> RingView | None:
    """Caller side: rank ``rank``'s ring now; None when it has none (the rank never got to
    record, or the file is not a ring)."""
    try:
        with (
            open(path(run_dir, rank), "rb") as f,
            mmap.mmap(f.fileno(), SIZE, access=mmap.ACCESS_READ) as mm,
        ):
            return parse(mm)
    except (OSError, ValueError):  # absent, or shorter than a ring
        return None


def parse(buf: bytes | mmap.mmap) -> RingView | None:
    """The ring in ``buf`` (the mapped file, or a copy of it), torn slots left out: each slot's
    counter is read before and after its copy (a seqlock's reader)."""
    if len(buf) < SIZE:
        return None
    magic, rank, pid, slots = _HEADER.unpack_from(buf, 0)
    if magic != MAGIC or slots != SLOTS:
        return None
    found = []
    for i in range(SLOTS):
        off = HEADER + i * SLOT
        before = _COUNTER.unpack_from(buf, off)[0]
        body = bytes(buf[off : off + SLOT])
        after = _COUNTER.unpack_from(buf, off)[0]
        counter, entered, left, seq, numel, peer, op, group, shapes, site = _SLOT.unpack(body)
        n = counter // 2
        # kept when complete (even), the same before and after the copy, and in its slot
        if counter == 0 or counter % 2 or before != after or before != counter:
            continue
        if (n - 1) % SLOTS != i:
            continue
        rec = OpRecord(
            _untext(op), _untext(group), seq, peer, numel, _untext(shapes), _untext(site),
            entered, left,
        )  # fmt: skip
        found.append((n, rec))
    found.sort(key=lambda x: x[0])
    written = found[-1][0] if found else 0
    # a ring holds the last SLOTS records: older survivors (torn neighbours) are dropped
    out = [rec for n, rec in found if n > written - SLOTS]
    return RingView(rank, pid, written, tuple(out))


__all__ = ["HEADER", "OpRecord", "REGIONS", "Ring", "RingView", "SIZE", "SLOT", "SLOTS", "LEFT_AT", "parse",
           "path", "read", "static_bytes"]  # fmt: skip
