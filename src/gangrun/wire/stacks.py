"""``stacks.<rank>``: a rank's stack dumps, appended by ``faulthandler`` on ``SIGUSR1``.

The rank opens the file under a temporary name (`open_unpublished`), registers the handler on
it, then gives it its final name (`publish`): a caller that sees the file (`ready`) may signal
the rank. The file only grows; the caller reads one dump as what was added since the size it
had before the signal (`size`, `read_since`), the user's threads first (`user_threads_first`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import IO

from .rundir import RunDir


@dataclass(frozen=True)
class StackDump:
    rank: int
    text: str  # every thread's stacks ("": the rank did not answer)


def path(run_dir: str, rank: int) -> str:
    return RunDir(run_dir).stacks(rank)


def open_unpublished(run_dir: str, rank: int) -> IO[str]:
    """The file the rank's dumps go to, not yet under its final name. Raises ``OSError``."""
    tmp = path(run_dir, rank) + ".installing"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    return os.fdopen(fd, "w")


def publish(run_dir: str, rank: int) -> None:
    final = path(run_dir, rank)
    os.rename(final + ".installing", final)


def ready(run_dir: str, rank: int) -> bool:
    """The rank's handler is installed (a rank still starting would be killed by SIGUSR1)."""
    return os.path.exists(path(run_dir, rank))


def size(run_dir: str, rank: int) -> int:
    try:
        return os.stat(path(run_dir, rank)).st_size
    except OSError:
        return 0


_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # gangrun/
_FILE = re.compile(r'^\s*File "([^"]*)"', re.MULTILINE)
_THREAD_HEAD = re.compile(r"^(?:Current thread|Thread) 0x[0-9a-fA-F]+ ", re.MULTILINE)


def _gangruns(block: str) -> bool:
    """Every frame of this thread is gangrun's (or ``threading``'s, which started it)."""
    files = _FILE.findall(block)
    return bool(files) and all(
        f.startswith(_OWN_DIR)
        or f"site-packages{os.sep}gangrun{os.sep}" in f  # a rank on another node's install
        or f.endswith(f"{os.sep}threading.py")
        for f in files
    )


def user_threads_first(dump: str) -> str:
    """A ``faulthandler`` dump with gangrun's own threads moved after the user's."""
    starts = [m.start() for m in _THREAD_HEAD.finditer(dump)]
    if len(starts) < 2:
        return dump
    head = dump[: starts[0]]
    blocks = [dump[a:b].strip("\n") for a, b in zip(starts, [*starts[1:], len(dump)], strict=True)]
    ours = [b for b in blocks if _gangruns(b)]
    theirs = [b for b in blocks if not _gangruns(b)]
    if not ours or not theirs:
        return dump
    return head + "\n\n".join(theirs + ours)


def read_since(run_dir: str, rank: int, offset: int) -> StackDump:
    """What rank ``rank`` dumped after the file had ``offset`` bytes, user's threads first."""
    try:
        with open(path(run_dir, rank), "rb") as f:
            f.seek(offset)
            return StackDump(rank, user_threads_first(f.read().decode("utf-8", "replace").strip()))
    except OSError:
        return StackDump(rank, "")


__all__ = [
    "StackDump",
    "open_unpublished",
    "path",
    "publish",
    "read_since",
    "ready",
    "size",
    "user_threads_first",
]
