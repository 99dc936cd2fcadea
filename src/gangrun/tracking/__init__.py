"""MLflow tracking of a call.

Two sides that never import each other: `caller` and `plan` run in the caller
(create/resume and end the call's run); `rank` runs in rank processes (ends the runs a
rank's own code opened before the rank exits). This package module imports neither, so a rank
importing `gangrun.tracking.rank` loads nothing of the caller side; the caller-side names
below are loaded on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .caller import Tracker
    from .plan import call_arguments, resolve_tracking_uri, run_link

_CALLER_SIDE = {
    "Tracker": "caller",
    "call_arguments": "plan",
    "resolve_tracking_uri": "plan",
    "run_link": "plan",
}

__all__ = ["Tracker", "call_arguments", "resolve_tracking_uri", "run_link"]


def __getattr__(name: str) -> Any:
    module = _CALLER_SIDE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
