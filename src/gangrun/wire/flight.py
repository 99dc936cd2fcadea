"""``flight.<rank>``: what torch's Flight Recorder holds for a rank (its last collectives with
their state on the device: ``scheduled``, ``started``, ``completed``), dumped by the rank on
the caller's request (`gangrun.rank.flight`) and read by the caller for the hang verdict.

The caller asks by touching ``flight.request``; a rank's recorder thread, which watches that
file, writes its `FlightDump` as one JSON document (temporary name + rename). A rank writes an
empty dump when its thread starts: the file's presence says the rank will answer.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from typing import Any

from .rundir import RunDir


@dataclass(frozen=True)
class FlightEntry:
    """One collective as torch's Flight Recorder saw it."""

    op: str  # "all_reduce" (torch's "nccl:all_reduce" without the library)
    seq: int  # its collective sequence number on its group
    state: str  # "scheduled", "started", "completed"
    group: str  # the process group's name
    sizes: str  # input sizes, e.g. "[[4]]"
    dtypes: str  # e.g. "Float"
    created: float  # wall clock


@dataclass(frozen=True)
class FlightDump:
    rank: int
    time: float  # when dumped (0.0: the thread's first, empty write)
    entries: tuple[FlightEntry, ...]

    def to_json(self) -> str:
        return json.dumps({"rank": self.rank, "time": self.time,
                           "entries": [asdict(e) for e in self.entries]})  # fmt: skip


def from_torch(rank: int, dump: dict[str, Any], keep: int = 8) -> FlightDump:
    """The last ``keep`` entries of ``torch._C._distributed_c10d._dump_fr_trace()``'s dict."""
    out = []
    for e in list(dump.get("entries") or [])[-keep:]:
        name = str(e.get("profiling_name", "?"))
        out.append(
            FlightEntry(
                op=name.split(":", 1)[-1],
                seq=int(e.get("collective_seq_id", -1)),
                state=str(e.get("state", "?")),
                group=str((e.get("process_group") or ("", ""))[-1]),
                sizes=str(e.get("input_sizes", "")),
                dtypes=",".join(map(str, e.get("input_dtypes") or [])),
                created=int(e.get("time_created_ns", 0)) / 1e9,
            )
        )
    return FlightDump(rank, time.time(), tuple(out))


def path(run_dir: str, rank: int) -> str:
    return RunDir(run_dir).flight(rank)


def request_path(run_dir: str) -> str:
    return RunDir(run_dir).flight_request


def write(run_dir: str, dump: FlightDump) -> None:
    """Rank side. Raises ``OSError``."""
    final = path(run_dir, dump.rank)
    tmp = f"{final}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(dump.to_json())
    os.replace(tmp, final)


def read(run_dir: str, rank: int) -> FlightDump | None:
    """Caller side: the rank's last dump; None when it has none (or it cannot be read)."""
    try:
        with open(path(run_dir, rank)) as f:
            raw = json.load(f)
        entries = tuple(
            FlightEntry(**{k: e[k] for k in FlightEntry.__dataclass_fields__})
            for e in raw.get("entries", [])
        )
        return FlightDump(int(raw["rank"]), float(raw["time"]), entries)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def request(run_dir: str) -> float:
    """Caller side: ask every recorder thread for a dump now; the request's time."""
    p = request_path(run_dir)
    now = time.time()
    try:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
        os.close(fd)
        os.utime(p, (now, now))
    except OSError:
        pass
    return now


def requested(run_dir: str) -> float:
    """Rank side: when the caller last asked (0.0: never)."""
    try:
        return os.stat(request_path(run_dir)).st_mtime
    except OSError:
        return 0.0


__all__ = ["FlightDump", "FlightEntry", "from_torch", "path", "read", "request", "requested",
           "write"]  # fmt: skip
