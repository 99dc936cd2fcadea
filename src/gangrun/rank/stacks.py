"""Every rank's Python stacks on request, while the call keeps running.

Rank side: `install` (called by `gangrun.rank.worker` at every rank's start, whatever
the options) registers ``faulthandler`` for ``SIGUSR1``, writing all threads' stacks to
``stacks.<rank>`` in the run directory (`gangrun.wire.stacks`); the file appears under its
final name only once the handler is in place, so a caller never signals a rank that would die
of ``SIGUSR1``. The cost
is one open file and one signal handler per rank; nothing runs until a dump is asked for.
User code that installs its own ``SIGUSR1`` handler replaces it (then no stack dump).

Caller side: `request` signals the given ranks and returns what each wrote *for this
request* (the file only grows: each dump is read from the size it had before the signal),
the user's threads first: gangrun's own (the liveness watchdog, the MLflow and SIGTERM
helpers: every frame in gangrun or ``threading``) come after them
(`gangrun.wire.stacks.user_threads_first`). Used by ``handle.stacks()``, ``gangrun stacks
RUN`` and the hang guard.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import time
from typing import IO

from ..wire import stacks as stack_file

_file: IO[str] | None = None  # kept open for faulthandler


def install(run_dir: str, rank: int) -> None:
    """In a rank: dump every thread's stack to ``stacks.<rank>`` on ``SIGUSR1``."""
    global _file
    try:
        _file = stack_file.open_unpublished(run_dir, rank)
        faulthandler.register(signal.SIGUSR1, file=_file, all_threads=True, chain=False)
        stack_file.publish(run_dir, rank)  # ready: the caller may signal from now on
    except (OSError, ValueError, RuntimeError):  # no stack dumps then; request() says so
        pass


def request(run_dir: str, pids: dict[int, int], wait: float = 2.0) -> dict[int, str]:
    """Signal every rank in ``pids`` (rank -> pid) whose handler is installed and collect the
    dumps: rank -> its stacks (``""``: the rank did not answer within ``wait`` seconds).
    Ranks not ready yet (still starting) are left out."""
    ranks = sorted(r for r in pids if stack_file.ready(run_dir, r))
    before = {r: stack_file.size(run_dir, r) for r in ranks}
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
        now = {r: stack_file.size(run_dir, r) for r in asked}
        if all(now[r] > before[r] for r in asked) and now == sizes:
            break  # every dump is there and no longer growing
        sizes = now
        time.sleep(0.05)
    return {r: stack_file.read_since(run_dir, r, before[r]).text for r in ranks}


__all__ = ["install", "request"]
