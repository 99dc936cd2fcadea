"""``heartbeat.<rank>``: the hang guard's heartbeat. The rank touches the file (`touch`, from
`gangrun.heartbeat()`); its modification time is the beat, which the caller reads (`read`,
`gangrun.lifecycle.hang`). The file has no content: its existence says the rank installed
the guard, its mtime when it last made progress.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .rundir import RunDir


@dataclass(frozen=True)
class Beat:
    rank: int
    time: float  # wall clock of the last beat


def path(run_dir: str, rank: int) -> str:
    return RunDir(run_dir).heartbeat(rank)


def touch(file: str) -> None:
    """Beat now (the file is made 0600 on the first beat). A missed beat is harmless: an
    error (the run directory is gone, the call is ending) is ignored."""
    try:
        os.utime(file)
    except FileNotFoundError:
        try:
            os.close(os.open(file, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600))
        except OSError:
            pass
    except OSError:
        pass


def read(run_dir: str, rank: int) -> Beat | None:
    """Rank ``rank``'s last beat; None before its first (the guard not installed yet)."""
    try:
        return Beat(rank, os.stat(path(run_dir, rank)).st_mtime)
    except OSError:
        return None


__all__ = ["Beat", "path", "read", "touch"]
