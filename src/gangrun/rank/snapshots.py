"""Memory snapshots of a rank: the state a `gangrun.Checkpointer` saves, also copied at step
boundaries into shared memory that outlives the rank (docs/long_runs.md, "Memory snapshots").

The call's keeper (`gangrun.host.keeper`) owns a directory in ``/dev/shm``; each rank keeps
two slots there (`gangrun.wire.snapshot`), writes the older one, and marks it complete
(header last) once its checksums are computed, in a background thread: the step waits for
the copy alone. Every rank snapshots at the same steps (the Checkpointer agrees on it with the
flag all-reduce it does each step anyway). How often: every ``memory_every`` steps, or by
default as often as keeps the copy within `BUDGET` of the step time, both measured as the
run goes. Past the memory cap (all ranks' two slots together), or for a state it cannot hold
(sharded tensors, a DeepSpeed engine), one line says so and the call keeps storage
checkpoints only.

After a restart within the call, `choose` gives the Checkpointer the newest step every rank
holds a complete slot of (newer than the newest storage checkpoint), loaded and
verified on every rank; anything else (a slot torn or damaged on one rank, the keeper gone)
falls back to storage with one line saying why.
"""

from __future__ import annotations

import math
import mmap
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..checkpoint import snapshots as flat_io
from ..host import keeper
from ..wire import contract
from ..wire import snapshot as slot_file

# the adaptive interval keeps the snapshots within 3% of the step time: the copy measured is
# held to 2.5%, the rest is room for what is not measured (the first snapshots, the agreement)
BUDGET = 0.025
_EMA = 0.2
_WARMUP = 2  # snapshots not timed: the first allocate the two slots
INLINE_BYTES = 1 << 20  # a smaller snapshot's checksums are computed in the training thread


class _Slot:
    """One slot file of this rank, mapped read-write."""

    def __init__(self, path: str, size: int) -> None:
        import torch

        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            if os.fstat(self.fd).st_size < size:
                os.posix_fallocate(self.fd, 0, size)  # tmpfs pages now: ENOSPC here, not SIGBUS
            self.size = os.fstat(self.fd).st_size
            self.mm = mmap.mmap(self.fd, self.size)
        except BaseException:
            os.close(self.fd)
            raise
        self.bytes = torch.frombuffer(self.mm, dtype=torch.uint8)

    def close(self) -> None:
        del self.bytes
        self.mm.close()
        os.close(self.fd)


def _say(text: str) -> None:
    print(f"gangrun: {text}", file=sys.stderr, flush=True)


class MemorySnapshots:
    """This rank's memory snapshots (see the module docstring)."""

    def __init__(self, root: str, rank: int, world: int, every: int | None, cap: int) -> None:
        self.root, self.rank, self.world = root, rank, world
        self.every, self.cap = every, cap
        self.enabled = True
        self._slots: list[_Slot | None] = [None, None]
        self._newest: tuple[int, int] | None = None  # (step, slot) of the newest complete
        self._commit: Future[None] | None = None  # the checksums of the last snapshot
        self._pool: ThreadPoolExecutor | None = None
        self._last = -1  # the step of the last snapshot
        self._step_s: float | None = None
        self._copy_s: float | None = None
        self._takes = 0
        self._mark: float | None = None  # when the last step_done ended

    @classmethod
    def from_env(cls, rank: int, world: int) -> MemorySnapshots | None:
        root = os.environ.get(contract.MEMORY_DIR)
        if not root:
            return None
        try:
            every = int(os.environ.get(contract.MEMORY_EVERY) or 0)
            cap = int(os.environ.get(contract.MEMORY_CAP) or 0)
        except ValueError:
            return None
        return cls(root, rank, world, every or None, cap)

    # ------------------------------------------------------------------ when
    def step_began(self) -> None:
        """The user's step just ended (called first thing in ``step_done``): its time."""
        if self._mark is not None:
            dt = time.perf_counter() - self._mark
            self._step_s = dt if self._step_s is None else (1 - _EMA) * self._step_s + _EMA * dt

    def step_ended(self) -> None:
        """``step_done`` returns: the user's next step starts now."""
        self._mark = time.perf_counter()

    def due(self, step: int) -> bool:
        """Whether this rank wants a snapshot after ``step`` steps (the ranks agree on MAX)."""
        if not self.enabled:
            return False
        if self.every is not None:
            return step % self.every == 0
        interval = self.interval
        return interval is None or self._last < 0 or step - self._last >= interval

    @property
    def interval(self) -> int | None:
        """The adaptive interval now (None before it is measured, or when forced)."""
        if self.every is not None or self._copy_s is None or self._step_s is None:
            return None
        return max(1, math.ceil(self._copy_s / (BUDGET * max(self._step_s, 1e-9))))

    # ------------------------------------------------------------------ taking
    def disable(self, why: str, everyone: bool = False) -> None:
        """Storage checkpoints only from here on, said once (``everyone``: a reason every
        rank shares, said by rank 0 alone)."""
        if not self.enabled:
            return
        self.enabled = False
        self.wait()
        if not everyone or self.rank == 0:
            who = "" if everyone else f"rank {self.rank}: "
            _say(f"{who}memory snapshots are off from here ({why}); storage checkpoints only.")

    def take(self, step: int, build: Callable[[], dict[str, Any]]) -> None:
        """Snapshot the save dict ``build()`` of ``step`` into the older slot."""
        t0 = time.perf_counter()
        self.wait()
        if not keeper.alive(self.root):
            self.disable(f"the snapshot keeper of {self.root} is gone", everyone=True)
            return
        try:
            flat = flat_io.flatten(build())
        except flat_io.Unsupported as exc:
            self.disable(f"the state holds what a memory snapshot does not: {exc}")
            return
        size = slot_file.data_offset(len(flat.meta)) + flat.data_len
        if 2 * size * self.world > self.cap:
            self.disable(
                f"two snapshots of every rank's state take {2 * size * self.world / 2**20:.0f}"
                f" MiB, over the cap of {self.cap / 2**20:.0f} MiB: a quarter of the memory "
                "available when the call started, and at most what /dev/shm has free"
            )
            return
        j = 1 - self._newest[1] if self._newest is not None else 0
        try:
            slot = self._open(j, size)
        except OSError as exc:
            self.disable(f"{slot_file.slot_path(self.root, self.rank, j)}: {exc}")
            return
        slot_file.invalidate(slot.mm)
        start = slot_file.data_offset(len(flat.meta))
        slot.mm[slot_file.HEADER : slot_file.HEADER + len(flat.meta)] = flat.meta
        flat_io.copy_into(flat, slot.bytes[start : start + flat.data_len])
        header = slot_file.SlotHeader(
            self.rank, self.world, step, len(flat.meta), 0, flat.data_len, 0, time.time()
        )
        if flat.data_len < INLINE_BYTES:  # checksums of a few KiB: cheaper than a handoff
            self._finish(slot, j, header)
        else:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="gangrun-snapshot")
            self._commit = self._pool.submit(self._finish, slot, j, header)
        self._last = step
        self._takes += 1
        if self._takes > _WARMUP:  # not the first ones: slots allocated, imports done
            dt = time.perf_counter() - t0
            self._copy_s = dt if self._copy_s is None else (1 - _EMA) * self._copy_s + _EMA * dt

    def _finish(self, slot: _Slot, j: int, h: slot_file.SlotHeader) -> None:
        mv = memoryview(slot.mm)
        meta = slot_file.crc32(mv[slot_file.HEADER : slot_file.HEADER + h.meta_len])
        start = slot_file.data_offset(h.meta_len)
        data = slot_file.data_crc(mv[start : start + h.data_len])
        del mv
        full = slot_file.SlotHeader(
            h.rank, h.world, h.step, h.meta_len, meta, h.data_len, data, h.time
        )
        slot_file.commit(slot.mm, full)
        self._newest = (h.step, j)

    def wait(self) -> None:
        """Until the snapshot in flight is complete."""
        if self._commit is not None:
            commit, self._commit = self._commit, None
            commit.result()

    def _open(self, j: int, size: int) -> _Slot:
        slot = self._slots[j]
        if slot is not None and slot.size >= size:
            return slot
        if slot is not None:
            self._slots[j] = None
            slot.close()
        page = mmap.PAGESIZE
        want = (size + size // 16 + page - 1) // page * page  # room to grow a little
        slot = _Slot(slot_file.slot_path(self.root, self.rank, j), want)
        self._slots[j] = slot
        return slot

    # ------------------------------------------------------------------ restoring
    def complete(self) -> dict[int, int]:
        """step -> slot of this rank's complete slots (headers only; `load` verifies)."""
        out: dict[int, int] = {}
        if not self.enabled:
            return out
        for j in (0, 1):
            h = self._header(j)
            if h is not None and h.rank == self.rank and h.world == self.world:
                out[h.step] = j
        return out

    def _header(self, j: int) -> slot_file.SlotHeader | None:
        try:
            with open(slot_file.slot_path(self.root, self.rank, j), "rb") as f:
                return slot_file.read_header(f.read(slot_file.HEADER))
        except OSError:
            return None

    def _open_slot(self, step: int, j: int) -> tuple[int, slot_file.SlotHeader] | str:
        """(an open fd, the header) of slot ``j`` holding a complete snapshot of ``step``, or
        why not."""
        path = slot_file.slot_path(self.root, self.rank, j)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            return f"{path}: {exc}"
        h = slot_file.read_header(os.pread(fd, slot_file.HEADER, 0))
        if h is None or h.step != step or h.rank != self.rank or h.world != self.world:
            os.close(fd)
            return f"{path} no longer holds a complete snapshot of step {step}"
        return fd, h

    def check(self, step: int, j: int) -> str | None:
        """Why slot ``j`` cannot be restored as step ``step`` (None: it can): its header,
        sizes, checksums and table of contents verified. Nothing is loaded."""
        opened = self._open_slot(step, j)
        if isinstance(opened, str):
            return opened
        fd, h = opened
        path = slot_file.slot_path(self.root, self.rank, j)
        try:
            size = os.fstat(fd).st_size
            if size < h.size:
                return f"{path} holds {size} bytes, its header records {h.size}"
            mm = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
            try:
                why = slot_file.verify(mm, h)
                if why is None:
                    flat_io.check_meta(mm[slot_file.HEADER : slot_file.HEADER + h.meta_len])
            finally:
                mm.close()
            return None if why is None else f"{path}: {why}"
        except Exception as exc:  # an unreadable table of contents: not restored
            return f"{path}: {type(exc).__name__}: {exc}"
        finally:
            os.close(fd)

    def read(self, step: int, j: int, template: Any = None) -> dict[str, Any]:
        """The save dict of slot ``j`` (`check`ed first, by every rank), read into the
        tensors of ``template`` where they fit (`gangrun.checkpoint.snapshots.unflatten`)."""
        opened = self._open_slot(step, j)
        if isinstance(opened, str):
            raise RuntimeError(f"rank {self.rank}: {opened}, after it was verified")
        fd, h = opened
        try:
            meta = os.pread(fd, h.meta_len, slot_file.HEADER)
            start = slot_file.data_offset(h.meta_len)
            pieces: list[tuple[memoryview, int]] = []  # (destination, offset in the file)

            def fill(dst: Any, off: int) -> None:
                view = memoryview(dst.numpy())
                for i in range(0, len(view), slot_file.CHUNK):
                    pieces.append((view[i : i + slot_file.CHUNK], start + off + i))

            def read_piece(piece: tuple[memoryview, int]) -> None:
                view, pos = piece
                while len(view):
                    got = os.preadv(fd, [view], pos)
                    if got <= 0:
                        raise RuntimeError(f"rank {self.rank}: slot {j} ended while read")
                    view, pos = view[got:], pos + got

            sd = flat_io.unflatten(meta, fill, template)
            workers = max(1, min(slot_file.THREADS, len(pieces), os.cpu_count() or 1))
            with ThreadPoolExecutor(workers, thread_name_prefix="gangrun-restore") as pool:
                list(pool.map(read_piece, pieces))  # preadv releases the GIL
            pieces.clear()
            return sd
        finally:
            os.close(fd)

    def restored(self, step: int | None, j: int | None) -> None:
        """The rank restored ``step`` from slot ``j`` (None: from storage, or nothing): every
        other slot of this rank is invalidated, so no snapshot of a timeline the restore
        left behind is ever restored."""
        self.wait()
        for k in (0, 1):
            if k == j:
                continue
            slot = self._slots[k]
            if slot is not None:
                slot_file.invalidate(slot.mm)
                continue
            try:
                fd = os.open(
                    slot_file.slot_path(self.root, self.rank, k), os.O_WRONLY | os.O_CLOEXEC
                )
            except OSError:
                continue
            try:
                os.pwrite(fd, bytes(64), 0)
            finally:
                os.close(fd)
        self._newest = (step, j) if step is not None and j is not None else None
        self._last = step if step is not None else -1

    def close(self) -> None:
        """Wait for the snapshot in flight; unmap the slots (the keeper removes the files)."""
        self.wait()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        for j, slot in enumerate(self._slots):
            if slot is not None:
                self._slots[j] = None
                slot.close()


def choose(
    mem: MemorySnapshots | None,
    storage_step: int | None,
    gather: Callable[[Any], list[Any]],
    template: Callable[[], Any] | None = None,
) -> tuple[int, dict[str, Any]] | None:
    """The newest snapshot to restore, every rank's slot of it loaded and verified: ``(step,
    this rank's save dict)``, or None (restore from storage). ``gather``: every rank's value
    (an all-gather; every rank calls `choose`); ``template()``: the state's own tensors to
    read into (`gangrun.checkpoint.state.load_template`), once every rank verified its slot."""
    mine: dict[int, int] = {}
    if mem is not None and mem.enabled:
        if keeper.alive(mem.root):
            mine = mem.complete()
        else:
            mem.disable(f"the snapshot keeper of {mem.root} is gone", everyone=True)
    everyone = gather(sorted(mine))
    common = set(everyone[0]).intersection(*everyone[1:]) if everyone else set()
    # newer than storage only: at the same step storage holds the same state, and a restore
    # from it names the checkpoint (``restored_from``)
    floor = -1 if storage_step is None else storage_step
    for step in sorted((s for s in common if s > floor), reverse=True):
        assert mem is not None
        whys = gather(mem.check(step, mine[step]))
        if all(w is None for w in whys):  # every rank's slot verified: now load
            sd = mem.read(step, mine[step], template() if template else None)
            mem.restored(step, mine[step])
            return step, sd
        bad = next(r for r, w in enumerate(whys) if w is not None)
        if (mem.rank if mem else 0) == 0:
            _say(
                f"the memory snapshot of step {step} cannot be restored: rank {bad}'s "
                f"{whys[bad]}; trying an older one, then storage."
            )
    if mem is not None and mem.enabled:
        mem.restored(None, None)
    return None


__all__ = ["BUDGET", "MemorySnapshots", "choose"]
