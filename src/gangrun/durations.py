"""Durations written as text, one parser for every channel.

``"90"``, ``"1.5"``, ``"90s"``, ``"15m"``, ``"2h"``, ``"1h30m"`` (seconds; ``"1h30"`` is
``"1h30m"``) and ``"none"`` mean the same in Python (``timeout="10m"``,
`gangrun.set_defaults`, ``Gang(...)``, the option groups), in ``GANGRUN_<OPTION>`` variables, in the process settings
(``GANGRUN_SLOW_AFTER=2m``), and on the command line (``--timeout 10m``,
``gangrun stacks RUN --timeout 2s``).
"""

from __future__ import annotations

import math
import numbers
import re
from typing import Any

_N = r"\d+(?:\.\d*)?"
_DURATION = re.compile(rf"^(?:(?P<h>{_N})h)?(?:(?P<m>{_N})m)?(?:(?P<s>{_N})s)?(?P<bare>{_N})?$")
FORMS = "seconds (90), or 90s, 15m, 2h, 1h30m (1h30 is 1h30m, 1m30 is 1m30s)"


def parse_duration(text: str) -> float | None:
    """``"90"``, ``"90s"``, ``"1.5"``, ``"15m"``, ``"2h"``, ``"1h30m"`` -> seconds; ``"none"``
    -> ``None``. A last number without a unit is in the unit after the one before it, as it
    is said: ``"1h30"`` is 1 h 30 min, ``"1m30"`` 1 min 30 s (a plain number: seconds).
    Raises ``ValueError`` saying what a duration is for anything else."""
    t = str(text).strip().lower().replace(" ", "")
    if t in ("none", "inf", "null"):
        return None
    m = _DURATION.match(t)
    if not t or m is None or not any(m.groupdict().values()) or (m["s"] and m["bare"]):
        raise ValueError(f"{text!r} is not a duration: give {FORMS}, or none")
    h, mi, s, bare = (float(m.group(k) or 0) for k in ("h", "m", "s", "bare"))
    # the bare number's unit: minutes after hours alone, else seconds
    value = h * 3600 + mi * 60 + s + bare * (60 if m["h"] and not m["m"] else 1)
    if math.isinf(value):
        raise ValueError(f"{text!r} is not a duration: too large")
    return value


def parse_seconds(text: str) -> float:
    """A duration that cannot be none (`parse_duration`): seconds, 0 or more."""
    value = parse_duration(text)
    if value is None:
        raise ValueError(f"{text!r} cannot be none here: give {FORMS}")
    return value


def finite_seconds(v: Any, above: float | None = None, least: float | None = None) -> bool:
    """Whether ``v`` is a finite real number of seconds ``> above`` / ``>= least`` (never a
    bool, NaN or an infinity: a NaN compares false to every bound and would pass as no
    limit)."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
        return False
    x = float(v)
    return (above is None or x > above) and (least is None or x >= least)


__all__ = ["FORMS", "finite_seconds", "parse_duration", "parse_seconds"]
