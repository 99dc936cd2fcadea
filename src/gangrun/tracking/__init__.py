"""MLflow tracking of a call.

The caller side: `caller` and `plan` create/resume and end the call's run. The rank side
(ending the runs a rank's own code opened before the rank exits) is `gangrun.rank.tracking`,
which imports nothing of this package. The names below are loaded on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .caller import Tracker
    from .plan import call_arguments, resolve_tracking_uri, run_link

_CALLER_SIDE = {
    "Tracker": "gangrun.tracking.caller",
    "call_arguments": "gangrun.tracking.plan",
    "resolve_tracking_uri": "gangrun.tracking.plan",
    "run_link": "gangrun.tracking.plan",
}

__all__ = ["Tracker", "call_arguments", "resolve_tracking_uri", "run_link"]


def __getattr__(name: str) -> Any:
    module = _CALLER_SIDE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
