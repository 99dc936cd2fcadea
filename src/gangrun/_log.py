"""gangrun's own diagnostics: ``logging.getLogger("gangrun")`` and its children.

Library etiquette: nothing is printed unless the user asks. With ``GANGRUN_LOG_LEVEL`` set
(``DEBUG``, ``INFO``, ``WARNING``, ``ERROR`` or a number) the ``gangrun`` logger gets that level
and one handler writing to stderr; without it the logger only has a ``NullHandler`` and the
application's own logging configuration decides. Rank output is not logging: it stays raw
text, prefixed ``[rank N]``.
"""

from __future__ import annotations

import logging
import os
import threading

ENV = "GANGRUN_LOG_LEVEL"
ROOT = "gangrun"
_configured = False
_lock = threading.Lock()


def _level(text: str) -> int | None:
    text = text.strip()
    if text.lstrip("-").isdigit():
        return int(text)
    level = logging.getLevelName(text.upper())
    return level if isinstance(level, int) else None


def configure(force: bool = False) -> logging.Logger:
    """Set up the ``gangrun`` logger from ``GANGRUN_LOG_LEVEL`` (once; ``force`` redoes it)."""
    global _configured
    root = logging.getLogger(ROOT)
    with _lock:
        if _configured and not force:
            return root
        for h in list(root.handlers):
            if getattr(h, "_gangrun", False):
                root.removeHandler(h)
        raw = os.environ.get(ENV, "").strip()
        handler: logging.Handler
        if raw:
            level = _level(raw)
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("gangrun %(levelname)s %(name)s: %(message)s"))
            root.setLevel(logging.WARNING if level is None else level)
        else:
            handler = logging.NullHandler()
        setattr(handler, "_gangrun", True)  # noqa: B010 - marks the handler as ours
        root.addHandler(handler)
        _configured = True
        if raw and _level(raw) is None:
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
