"""A first call as fast as the later ones: start the fork server in the background.

When a function is decorated in a kernel, :func:`prewarm_soon` starts the fork server (the
slow part of a first call: a fresh interpreter importing torch) from a daemon thread, so a call made a few seconds later finds it ready. Failures are only logged: the
call itself then starts the server, or falls back to spawning, as it would have anyway.
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger("gangrun.notebook")

_started = False
_lock = threading.Lock()


def prewarm(pool: int = 2) -> None:
    """Start this caller's fork server now (the one seam onto the launch package)."""
    from ..launch import forkserver

    if os.environ.get("GANGRUN_START_METHOD", "auto") == "spawn" or not forkserver.usable():
        return
    forkserver.prewarm(pool)


def _run() -> None:
    # Not reniced: the server (and every rank forked from it) would inherit the nice value,
    # and an unprivileged process cannot raise it back. The work runs in the server's own
    # process anyway; this thread only waits for it.
    try:
        prewarm()
    except Exception as exc:
        log.info("gangrun: the fork server could not be started ahead of the call: %s", exc)


def prewarm_soon() -> bool:
    """Start :func:`prewarm` in a daemon thread, once per process. True if it started now."""
    global _started
    with _lock:
        if _started:
            return False
        _started = True
    threading.Thread(target=_run, name="gangrun-prewarm", daemon=True).start()
    return True


__all__ = ["prewarm", "prewarm_soon"]
