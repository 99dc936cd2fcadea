"""The call's "done" flag, with hooks around its setting: what `RunHandle`'s
``concurrent.futures.Future`` surface rests on.

A hook has two halves. ``settle()`` runs BEFORE the flag is set, under the event's lock (so a
waiter woken by the flag, or `Supervisor.wait` returning, sees the handle's future state
already final); it must be quick and must not raise. ``notify()`` runs AFTER (the user's done
callbacks), in the thread that ends the call. A hook added once the flag is set runs both
halves at once, in the adding thread.

The event holds its hooks only until it is set, and a hook holds nothing that keeps the
handle alive (the handle's run directory goes when the handle is collected).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Protocol

log = logging.getLogger("gangrun.lifecycle.done")


class DoneHook(Protocol):
    def settle(self) -> None:
        """Make the end visible (before the flag is set): quick, never raises."""

    def notify(self) -> None:
        """Run what waits for the end (after the flag is set)."""


class DoneEvent(threading.Event):
    """A `threading.Event` whose `set` runs the hooks' ``settle`` halves first and their
    ``notify`` halves after, once."""

    def __init__(self) -> None:
        super().__init__()
        self._hooks_lock = threading.Lock()
        self._hooks: list[DoneHook] | None = []  # None once set

    def subscribe(self, hook: DoneHook) -> None:
        with self._hooks_lock:
            if self._hooks is not None:
                self._hooks.append(hook)
                return
        _run(hook.settle)
        _run(hook.notify)

    def set(self) -> None:
        with self._hooks_lock:
            hooks, self._hooks = self._hooks or [], None
            for hook in hooks:
                _run(hook.settle)
            super().set()
        for hook in hooks:
            _run(hook.notify)


def _run(step: Callable[[], None]) -> None:
    try:
        step()
    except Exception:  # a hook's failure never stops the call's end
        log.exception("a done hook failed")


__all__ = ["DoneEvent", "DoneHook"]
