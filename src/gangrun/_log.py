"""gangrun's own diagnostics: ``logging.getLogger("gangrun")`` and its children.

Library etiquette, without hiding what a user needs to know: gangrun adds no handler of its
own by default, so its warnings and errors ("rank 1: its log file is incomplete: No space left
on device") reach stderr through Python's last-resort handler when the application configured
no logging, and go through the application's own handlers and levels when it did; debug and
info records stay silent. With ``GANGRUN_LOG_LEVEL`` set (``DEBUG``, ``INFO``, ``WARNING``,
``ERROR`` or a number) the ``gangrun`` logger gets that level and one handler writing to
stderr. `configure` runs at the start of every call (``submit()``), so the variable is
honoured without any code. Rank output is not logging: it stays raw text, prefixed
``[rank N]``.
"""

from __future__ import annotations

import logging
import os
import threading

from .settings import log_level
from .wire.contract import LOG_LEVEL as ENV

ROOT = "gangrun"
_configured = False
_lock = threading.Lock()


def configure(force: bool = False) -> logging.Logger:
    """Set up the ``gangrun`` logger from ``GANGRUN_LOG_LEVEL`` (once; ``force`` redoes it).

    Unset: no handler of gangrun's own (warnings reach stderr or the application's
    handlers, see the module docstring)."""
    global _configured
    root = logging.getLogger(ROOT)
    with _lock:
        if _configured and not force:
            return root
        ours = [h for h in root.handlers if getattr(h, "_gangrun", False)]
        for h in ours:
            root.removeHandler(h)
        if ours:
            root.setLevel(logging.NOTSET)  # the level was ours too
        raw = os.environ.get(ENV, "").strip()
        if raw:
            level = log_level(raw)
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("gangrun %(levelname)s %(name)s: %(message)s"))
            root.setLevel(logging.WARNING if level is None else level)
            setattr(handler, "_gangrun", True)  # noqa: B010 - marks the handler as ours
            root.addHandler(handler)
        # Without it: no handler (not even a NullHandler, which would silence the last-resort
        # handler and with it every warning of an application that configured no logging).
        _configured = True
        if raw and log_level(raw) is None:
            root.warning(
                "%s=%r is not a log level (DEBUG, INFO, WARNING, ERROR or a number); using WARNING",
                ENV,
                raw,
            )
    return root


def get_logger(name: str | None = None) -> logging.Logger:
    """The ``gangrun`` logger, or its child ``gangrun.<name>`` (``__name__`` works too)."""
    configure()
    if not name or name == ROOT:
        return logging.getLogger(ROOT)
    if name.startswith(ROOT + "."):
        return logging.getLogger(name)
    return logging.getLogger(f"{ROOT}.{name}")


__all__ = ["get_logger", "configure", "ENV"]
