"""The caller's process settings (`gangrun.wire.contract.SETTINGS`), each read by one parser.

The modules that use a setting (`gangrun.lifecycle.watch`, `gangrun.tracking.bounded`,
`gangrun._log`, `gangrun.data.cache`) and ``gangrun info`` read it through `read`, so what
``info`` shows as in force is what a call uses. A variable whose value cannot be used
(``GANGRUN_SLOW_AFTER=abc``) leaves the built-in default in force; `read` says so
(`Setting.rejected` and `Setting.why`), ``gangrun info`` shows it beside the value in force
and ``gangrun info --check`` fails on it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

from .durations import parse_seconds
from .wire import contract


@dataclass(frozen=True)
class Setting:
    """One setting: the value in force (as text, as its variable is written) and where it
    comes from; ``rejected``/``why``: the variable's value that could not be used, and why."""

    var: str
    value: str
    source: str  # "built-in" or "env VAR"
    rejected: str | None = None
    why: str | None = None

    def row(self) -> dict[str, object]:
        """``gangrun info``'s row (JSON)."""
        row: dict[str, object] = {"value": self.value, "source": self.source}
        if self.rejected is not None:
            row["rejected"] = {"value": self.rejected, "why": self.why}
        return row


def seconds(text: str) -> float:
    """A duration, 0 or more (``90``, ``1.5``, ``90s``, ``2m``, ``1h30m``): the parser of
    every duration gangrun reads (`gangrun.durations`), ``none`` excepted."""
    return parse_seconds(text)


def positive_seconds(text: str) -> float:
    value = seconds(text)
    if value <= 0:
        raise ValueError("not more than 0")
    return value


def log_level(text: str) -> int | None:
    """A `logging` level: a name (``DEBUG``, ``info``...) or a number; ``None`` when neither."""
    text = text.strip()
    if text.lstrip("-").isdigit():
        return int(text)
    level = logging.getLevelName(text.upper())
    return level if isinstance(level, int) else None


def _level(text: str) -> int:
    level = log_level(text)
    if level is None:
        raise ValueError("not a level")
    return level


def _host(text: str) -> str:
    text = text.strip()
    if not text or any(c.isspace() for c in text) or "/" in text:
        raise ValueError("not a host")
    return text


# variable -> (parser: raises ValueError on a value it cannot use, what a good value is)
_PARSERS: dict[str, tuple[Callable[[str], object], str]] = {
    contract.SLOW_AFTER: (seconds, "not a duration (0 or more, e.g. 60, 90s or 2m)"),
    contract.SILENT_AFTER: (seconds, "not a duration (0 or more, e.g. 120, 90s or 2m)"),
    contract.TRACKING_TIMEOUT: (
        positive_seconds,
        "not a duration over 0 (e.g. 60, 90s or 2m)",
    ),
    contract.LOG_LEVEL: (_level, "not a log level (DEBUG, INFO, WARNING, ERROR or a number)"),
    contract.CACHE_DIR: (str, "not a directory"),
    contract.RAY_CALLER_DEADLINE: (
        positive_seconds,
        "not a number of seconds over 0 (e.g. 5 or 10s)",
    ),
    contract.GANG_HOST: (_host, "not a host name or address (e.g. 10.0.0.5)"),
}


def read(var: str) -> Setting:
    """The setting ``var`` (one of `gangrun.wire.contract.SETTINGS`) as the process uses it now."""
    default = contract.SETTINGS[var][0]
    raw = os.environ.get(var)
    if raw is None or not raw.strip():
        return Setting(var, default, "built-in")
    parse, why = _PARSERS[var]
    try:
        parse(raw)
    except (ValueError, OverflowError):
        return Setting(var, default, "built-in", rejected=raw, why=why)
    return Setting(var, raw, f"env {var}")


def seconds_in_force(var: str, default: float) -> float:
    """A seconds setting's value in force: ``default`` when unset or rejected."""
    s = read(var)
    return default if s.source == "built-in" else seconds(s.value)


def read_all() -> dict[str, Setting]:
    return {var: read(var) for var in contract.SETTINGS}


__all__ = [
    "Setting",
    "log_level",
    "positive_seconds",
    "read",
    "read_all",
    "seconds",
    "seconds_in_force",
]
