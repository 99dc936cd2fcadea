"""The calls active in this process, and the one ``atexit`` hook that tears them down.

At interpreter exit, in this order, from ONE hook: close what asked to be closed first
(`on_exit`: the open interactive gangs, whose MLflow runs end FINISHED as
``docs/interactive.md`` promises), then cancel every call of *this* process still active
(waiting for each to end, so its MLflow run is KILLED and its ranks are gone), then shut the
launchers down (the fork server). A forked child of the caller inherits the registry and the hook, but the calls are
its parent's: the child forgets them at fork, and the hook does nothing there, at once.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from collections.abc import Callable
from typing import Protocol

log = logging.getLogger("gangrun.lifecycle.calls")


class Cancellable(Protocol):
    """An active call (`gangrun.lifecycle.supervisor.Supervisor`)."""

    owner_pid: int
    ckpt_env: dict[str, str]  # its ranks' checkpoint environment ({}: no checkpoints)

    def cancel(
        self, reason: str = "cancelled", wait: float = 30.0, checkpoint: bool = False
    ) -> bool: ...


_lock = threading.Lock()
_active: set[Cancellable] = set()
_owner_pid = os.getpid()
_closers: list[Callable[[], None]] = []  # run first at exit, in registration order


def on_exit(closer: Callable[[], None]) -> None:
    """Run ``closer`` at interpreter exit before the active calls are cancelled (an
    interactive gang closes itself cleanly instead of being cancelled as a call)."""
    if closer not in _closers:
        _closers.append(closer)
    _register()


def _register() -> None:
    # atexit runs hooks last-registered first: re-registering puts this one ahead of hooks
    # registered since (MLflow's, imported with the first tracked call), so calls end while
    # what they need is still there.
    atexit.unregister(at_exit)
    atexit.register(at_exit)


def _forget_in_child() -> None:
    global _owner_pid, _lock
    _lock = threading.Lock()  # a thread of the parent may have held it at the fork
    _active.clear()
    _owner_pid = -1  # this process owns no call until it starts one itself


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def add(call: Cancellable) -> None:
    global _owner_pid
    with _lock:
        _owner_pid = os.getpid()
        _active.add(call)
    _register()


def discard(call: Cancellable) -> None:
    with _lock:
        _active.discard(call)


def active() -> list[Cancellable]:
    pid = os.getpid()
    with _lock:
        return [c for c in _active if c.owner_pid == pid]


def stop_all(reason: str = "stopped because the caller is exiting") -> None:
    """Cancel every call still active in this process (not those of a parent we forked from)."""
    for call in active():
        call.cancel(reason, wait=10.0)


def at_exit() -> None:
    if os.getpid() != _owner_pid:
        return  # a forked child of the caller (or no call ever started here): nothing is ours
    for closer in list(_closers):
        try:
            closer()
        except Exception:
            log.exception("closing at exit failed")
    stop_all()
    _shutdown_launchers()


def _shutdown_launchers() -> None:
    from ..launch import shutdown

    try:
        shutdown()
    except Exception:
        log.exception("shutting the launchers down at exit failed")


atexit.register(at_exit)

__all__ = ["add", "discard", "active", "stop_all", "at_exit", "on_exit"]
