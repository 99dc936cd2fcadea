"""``memory.<rank>``: a rank's last memory sample (`MemorySample`), one fixed-size JSON line
the rank overwrites in place about once a second (`gangrun.rank.memory`) and the caller reads
(`read`, `read_all`): the panel's rank rows, ``gangrun ps``, the MLflow system metrics, and,
once the rank is dead, the out-of-memory verdict (`gangrun.lifecycle.oom`), which needs the
memory cgroup the rank was in (its pid is gone by then).

Also the one way gangrun writes a number of bytes for people: `fmt_bytes`.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from typing import Any

from .rundir import RunDir

SIZE = 1024  # bytes of the line (a cgroup path longer than ~700 characters is cut)


@dataclass(frozen=True)
class MemorySample:
    """One rank's memory at ``time`` (wall clock): the resident memory of its process tree
    (the rank and its descendants: DataLoader workers, subprocesses), the limit that applies
    to it and where that limit comes from, and what PyTorch holds on its GPU (``None``: no
    GPU in use)."""

    rank: int
    pid: int
    time: float
    rss: int  # bytes resident, the rank's process tree
    limit: int | None = None  # bytes: the memory cgroup's limit, else the machine's RAM
    cgroup: str | None = None  # the memory cgroup as /proc/PID/cgroup names it ("/a/b")
    cgroup_version: int | None = None  # 1 or 2
    oom_kills: int | None = None  # the cgroup's oom_kill counter at this sample
    cuda_device: int | None = None
    cuda_allocated: int | None = None  # bytes (torch.cuda.memory_allocated)
    cuda_reserved: int | None = None  # bytes (torch.cuda.memory_reserved)
    growth: float | None = None  # bytes per second of rss since the sample before
    sampler_tid: int | None = None  # the sampler thread's own id: its /proc reads are no progress

    def rss_at(self, when: float) -> int:
        """Its resident memory at ``when`` if it went on growing as it did (never less than
        sampled)."""
        if not self.growth or self.growth < 0 or when <= self.time:
            return self.rss
        return int(self.rss + self.growth * (when - self.time))

    @property
    def share(self) -> float | None:
        """``rss / limit`` (None: no limit known)."""
        return self.rss / self.limit if self.limit else None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    def to_bytes(self) -> bytes:
        """The sample as the file holds it: `SIZE` bytes (a cgroup name too long to fit is
        left out: the figures stay)."""
        line = self.to_json()
        if len(line) >= SIZE:
            line = MemorySample(**{**asdict(self), "cgroup": None}).to_json()
        return line.ljust(SIZE - 1).encode() + b"\n"

    @classmethod
    def from_json(cls, text: str | bytes) -> MemorySample | None:
        """The sample, or None (torn, garbled, or not a sample). Unknown keys are ignored."""
        try:
            raw = json.loads(text)
            if not isinstance(raw, dict):
                return None
            known = {f.name for f in fields(cls)}
            s = cls(**{k: v for k, v in raw.items() if k in known})
            if not all(isinstance(v, int) for v in (s.rank, s.pid, s.rss)):
                return None
            return s
        except (ValueError, TypeError):
            return None

    def text(self) -> str:
        """``1.2 GiB of 12 GiB (10%)``, then ``· cuda:0 3.0 GiB allocated, 4.0 GiB
        reserved`` where a GPU is in use."""
        out = fmt_bytes(self.rss)
        if self.limit:
            out += f" of {fmt_bytes(self.limit)} ({100 * self.rss / self.limit:.0f}%)"
        if self.cuda_allocated is not None:
            out += (
                f" · cuda:{self.cuda_device or 0} {fmt_bytes(self.cuda_allocated)} allocated, "
                f"{fmt_bytes(self.cuda_reserved or 0)} reserved"
            )
        return out


def fmt_bytes(n: float) -> str:
    """``11.2 GiB``, ``300 MiB``, ``512 KiB``, ``17 B``."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            v = n / size
            return f"{v:.1f} {unit}" if v < 100 and v != int(v) else f"{v:.0f} {unit}"
    return f"{int(n)} B"


def open_for_writing(run_dir: str, rank: int) -> int:
    """The rank's file, opened once (0600) for every `write`. Raises ``OSError``."""
    return os.open(RunDir(run_dir).memory(rank), os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)


def write(fd: int, sample: MemorySample) -> None:
    """Overwrite the sample in place (a torn read is None). Raises ``OSError``."""
    os.pwrite(fd, sample.to_bytes(), 0)


def read(run_dir: str, rank: int) -> MemorySample | None:
    """Caller side: rank ``rank``'s last sample, or None (none yet, or a torn read)."""
    try:
        with open(RunDir(run_dir).memory(rank), "rb") as f:
            raw = f.read(SIZE)
    except OSError:
        return None
    s = MemorySample.from_json(raw.strip())
    return s if s is not None and s.rank == rank else None


def read_all(run_dir: str, world_size: int) -> dict[int, MemorySample]:
    """Every rank's last sample (ranks without one are absent)."""
    out = {}
    for r in range(world_size):
        s = read(run_dir, r)
        if s is not None:
            out[r] = s
    return out


def nearest_limit(samples: dict[int, MemorySample]) -> tuple[int, MemorySample] | None:
    """The rank nearest its limit (highest share), or None (no limit known)."""
    known: list[tuple[float, int, MemorySample]] = [
        (s.share, r, s) for r, s in samples.items() if s.share is not None
    ]
    if not known:
        return None
    _share, r, s = max(known, key=lambda t: (t[0], -t[1]))
    return r, s


__all__ = [
    "SIZE",
    "MemorySample",
    "fmt_bytes",
    "nearest_limit",
    "open_for_writing",
    "read",
    "read_all",
    "write",
]
