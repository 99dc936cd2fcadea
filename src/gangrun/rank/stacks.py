"""Every rank's Python stacks on request, while the call keeps running.

Rank side: `install` (called by `gangrun.rank.worker` at every rank's start, whatever
the options) registers ``faulthandler`` for ``SIGUSR1``, writing all threads' stacks to
``stacks.<rank>`` in the run directory; the file appears under its final name only once the
handler is in place, so a caller never signals a rank that would die of ``SIGUSR1``. The cost
is one open file and one signal handler per rank; nothing runs until a dump is asked for.
User code that installs its own ``SIGUSR1`` handler replaces it (then no stack dump).

Caller side: `request` signals the given ranks and returns what each wrote *for this
request* (the file only grows: each dump is read from the size it had before the signal),
the user's threads first: gangrun's own (the liveness watchdog, the MLflow and SIGTERM
helpers: every frame in gangrun or ``threading``) come after them (`user_threads_first`).
Used by ``handle.stacks()``, ``gangrun stacks RUN`` and the hang guard.
"""

from __future__ import annotations

import faulthandler
import os
import re
import signal
import time
from typing import IO

from ..wire.rundir import RunDir

_file: IO[str] | None = None  # kept open for faulthandler


def path(run_dir: str, rank: int) -> str:
    return RunDir(run_dir).stacks(rank)


def install(run_dir: str, rank: int) -> None:
    """In a rank: dump every thread's stack to ``stacks.<rank>`` on ``SIGUSR1``."""
    global _file
    final = path(run_dir, rank)
    tmp = final + ".installing"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        _file = os.fdopen(fd, "w")
        faulthandler.register(signal.SIGUSR1, file=_file, all_threads=True, chain=False)
        os.rename(tmp, final)  # ready: the caller may signal from now on
    except (OSError, ValueError, RuntimeError):  # no stack dumps then; request() says so
        pass


def ready(run_dir: str, rank: int) -> bool:
    """The rank's handler is installed (a rank still starting would be killed by SIGUSR1)."""
    return os.path.exists(path(run_dir, rank))


def _size(p: str) -> int:
    try:
        return os.stat(p).st_size
    except OSError:
        return 0


_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
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


def request(run_dir: str, pids: dict[int, int], wait: float = 2.0) -> dict[int, str]:
    """Signal every rank in ``pids`` (rank -> pid) whose handler is installed and collect the
    dumps: rank -> its stacks (``""``: the rank did not answer within ``wait`` seconds).
    Ranks not ready yet (still starting) are left out."""
    ranks = sorted(r for r in pids if ready(run_dir, r))
    before = {r: _size(path(run_dir, r)) for r in ranks}
    asked = []
    for r in ranks:
        try:
            os.kill(pids[r], signal.SIGUSR1)
            asked.append(r)
        except (ProcessLookupError, PermissionError):  # exited meanwhile
            pass
    deadline = time.monotonic() + wait
    sizes: dict[int, int] = {}
    while asked and time.monotonic() < deadline:
        now = {r: _size(path(run_dir, r)) for r in asked}
        if all(now[r] > before[r] for r in asked) and now == sizes:
            break  # every dump is there and no longer growing
        sizes = now
        time.sleep(0.05)
    out: dict[int, str] = {}
    for r in ranks:
        try:
            with open(path(run_dir, r), "rb") as f:
                f.seek(before[r])
                out[r] = user_threads_first(f.read().decode("utf-8", "replace").strip())
        except OSError:
            out[r] = ""
    return out


__all__ = ["install", "ready", "request", "path", "user_threads_first"]
