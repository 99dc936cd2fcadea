"""A first call as fast as the later ones: start the fork server in the background.

When a function is decorated in a kernel, `prewarm_soon` starts the fork server (the
slow part of a first call: a fresh interpreter importing torch) from a daemon thread, so a call
made a few seconds later finds it ready. The same thread then imports the modules a call needs
in the caller (`CALL_MODULES`: the launcher, the output pump, the pre-launch checks,
cloudpickle, and in a kernel the live panel), which a first call otherwise imported on its way
(20 ms of a 50 ms first call). Failures are only logged: the call itself
then starts the server, or falls back to spawning, as it would have anyway.
"""

from __future__ import annotations

import importlib
import logging
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..options import ForkServerOptions

log = logging.getLogger("gangrun.notebook")

_started = False
_lock = threading.Lock()
_thread: threading.Thread | None = None

# What a call imports in the caller on its way to the first rank (tests/system/
# test_notebook_experience.py checks that a call after the prewarm imports nothing new).
CALL_MODULES = (
    "cloudpickle",
    "psutil",
    "gangrun._log",
    "gangrun.lifecycle.supervisor",
    "gangrun.lifecycle.control",
    "gangrun.lifecycle.narrate",
    "gangrun.lifecycle.hang",
    "gangrun.launch.gang",
    "gangrun.launch.limits",
    "gangrun.launch.forkserver.spawner",
    "gangrun.output",
    "gangrun.wire.serialization",
    "gangrun.checks",
    "gangrun.rank.source",
)
KERNEL_MODULES = (
    "gangrun.notebook.routing",
    "gangrun.notebook.panel",
    "gangrun.notebook.html",
)


def prewarm(pool: int = 2, settings: ForkServerOptions | None = None) -> None:
    """Start this caller's fork server now (the one seam onto the launch package), with
    the decorated function's ``forkserver`` settings. Whether to (``start_method``) is the
    caller's choice: `gangrun.notebook.session.on_decorate` reads the resolved option."""
    from ..launch import forkserver

    if not forkserver.usable():
        return
    forkserver.prewarm(pool, settings)


def _run(settings: ForkServerOptions | None) -> None:
    # Not reniced: the server (and every rank forked from it) would inherit the nice value,
    # and an unprivileged process cannot raise it back. The work runs in the server's own
    # process anyway; this thread only waits for it.
    try:
        prewarm(settings=settings)
    except Exception as exc:
        log.info("gangrun: the fork server could not be started ahead of the call: %s", exc)
    import_call_modules()


def import_call_modules() -> None:
    """Import what a call needs in the caller (`CALL_MODULES`, and in a kernel
    `KERNEL_MODULES`), so the first call does not."""
    from . import in_kernel

    names = CALL_MODULES + (KERNEL_MODULES if in_kernel() else ())
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as exc:  # e.g. a broken optional install: the call reports it
            log.info("gangrun: could not import %s ahead of the call: %s", name, exc)


def prewarm_soon(settings: ForkServerOptions | None = None) -> bool:
    """Start `prewarm` in a daemon thread, once per process. True if it started now."""
    global _started, _thread
    with _lock:
        if _started:
            return False
        _started = True
        _thread = threading.Thread(
            target=_run, args=(settings,), name="gangrun-prewarm", daemon=True
        )
    _thread.start()
    return True


def wait(timeout: float | None = None) -> bool:
    """Wait for the background prewarm to finish; True when it has (or never started)."""
    t = _thread
    if t is None:
        return True
    t.join(timeout)
    return not t.is_alive()


__all__ = ["prewarm", "prewarm_soon", "import_call_modules", "wait", "CALL_MODULES"]
