"""One `gangrun.Checkpointer` per location in a rank: the second one on a location already
used by a live manager of this process is an error when it is made (two managers would write
the same step directories and commit markers, and torch would fail later with a bare
``CheckpointException``). A manager frees its location in ``close()`` (``steps()`` closes
it at its end) or when it is garbage-collected.

This is per process: calls are kept apart by the caller's lock on the call's
``checkpoint_dir`` (`gangrun.checkpoint.writer`); a ``Checkpointer(dir=...)`` naming a
location the call does not hold is not locked against other calls.
"""

from __future__ import annotations

import os
import sys
import threading
import weakref
from typing import Any

_lock = threading.Lock()
_live: dict[str, tuple[weakref.ref[Any], str]] = {}  # location -> (manager, where it was made)


def key(url: str) -> str:
    """One spelling per location: no trailing slash, no ``file://``, local paths absolute."""
    url = url.rstrip("/")
    if url.startswith("file://"):
        url = url[len("file://") :]
    return url if "://" in url else os.path.abspath(os.path.expanduser(url))


def _made_at() -> str:
    frame = sys._getframe(2)  # the caller of Checkpointer(...)
    while frame is not None and frame.f_globals.get("__name__", "").startswith("gangrun.rank"):
        frame = frame.f_back  # type: ignore[assignment]
    return "?" if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno}"


def claim(url: str, manager: Any) -> None:
    """Register ``manager`` on ``url``; a RuntimeError if a live manager already uses it."""
    k = key(url)
    at = _made_at()
    with _lock:
        held = _live.get(k)
        if held is not None and held[0]() not in (None, manager):
            raise RuntimeError(
                f"Checkpointer: {url!r} is already used by another Checkpointer of this rank "
                f"(made at {held[1]}; this one at {at}). Two managers on one location would "
                "write the same step directories. Put every object in one manager's state "
                "mapping, give this one its own dir=..., or close() the first one before "
                "making this one."
            )
        _live[k] = (weakref.ref(manager), at)


def release(url: str, manager: Any) -> None:
    """``manager`` no longer uses ``url`` (nothing if another manager holds it)."""
    k = key(url)
    with _lock:
        held = _live.get(k)
        if held is not None and held[0]() in (manager, None):
            del _live[k]


__all__ = ["claim", "release", "key"]
