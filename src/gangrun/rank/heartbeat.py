"""The hang verdict's heartbeat (``hang_timeout``): one of the signs of a rank's progress.

`heartbeat` touches ``heartbeat.<rank>`` in the private run directory
(`gangrun.wire.heartbeat`); the caller's half, which reads it with the rank's CPU time, I/O,
output and step reports, is `gangrun.lifecycle.hang`.
"""

from __future__ import annotations

import time

from ..wire import heartbeat as beat_file

_MIN_BEAT_INTERVAL_S = 0.25
_last_beat = 0.0
_beat_path: str | None = None


def heartbeat() -> None:
    """Tell the hang verdict this rank is making progress (cheap; a no-op outside a rank or
    when ``hang_timeout`` is off). Rarely needed: CPU time, I/O, output and step reports count
    already; call it where a rank legitimately waits without any of them."""
    global _last_beat
    path = _beat_path
    if path is None:
        return
    now = time.monotonic()
    if now - _last_beat < _MIN_BEAT_INTERVAL_S:
        return
    _last_beat = now
    beat_file.touch(path)


def install(run_dir: str, rank: int) -> None:
    """In a rank, when the guard is on: the heartbeat file (the stack dump on SIGUSR1 is
    installed in every rank: `gangrun.rank.stacks.install`)."""
    global _beat_path
    _beat_path = beat_file.path(run_dir, rank)
    heartbeat()


__all__ = ["heartbeat", "install"]
