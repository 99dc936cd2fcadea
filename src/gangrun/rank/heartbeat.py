"""The rank half of the stuck-rank guard (``hang_timeout``): the heartbeat.

A rank counts as making progress when it writes output or calls `heartbeat` (which touches
``heartbeat.<rank>`` in the private run directory: `gangrun.wire.heartbeat`). The caller half, which watches those
files and stops a silent gang, is `gangrun.lifecycle.hang`.
"""

from __future__ import annotations

import time

from ..wire import heartbeat as beat_file

_MIN_BEAT_INTERVAL_S = 0.25
_last_beat = 0.0
_beat_path: str | None = None


def heartbeat() -> None:
    """Tell the stuck-rank guard this rank is making progress (cheap; a no-op outside a rank
    or when ``hang_timeout`` is off). Call it in the training loop, e.g. once per step."""
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
