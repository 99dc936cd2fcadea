"""gangrun: run a training function on every GPU of a node, straight from a notebook.

>>> from gangrun import distributed
>>> @distributed(processes=2)
... def train(epochs: int) -> float: ...
>>> losses = train.distributed(epochs=3)  # one entry per rank, rank order

Importing gangrun is cheap: torch, mlflow and ray are imported only where used.
"""

from __future__ import annotations

from .errors import (
    DistributedError,
    DistributedHangError,
    DistributedPreemptedError,
    DistributedTimeoutError,
    GangError,
    LaunchError,
)

# The one source of the version (pyproject.toml reads it there: setuptools dynamic).
from .version import __version__

TYPE_CHECKING = False  # not `typing.TYPE_CHECKING`: importing typing is most of our import time
if TYPE_CHECKING:  # pragma: no cover
    from typing import Any

    from .api import DistributedFunction, Options, RunHandle, distributed
    from .defaults import reset_defaults, set_defaults
    from .errors import DistributedCancelledError
    from .host.accelerators import backend, device
    from .interactive.magic import load_ipython_extension
    from .interactive.session import Gang
    from .options import ForkServerOptions, RayOptions
    from .rank.checkpointer import Checkpointer, should_stop
    from .rank.heartbeat import heartbeat
    from .rank.interactive import rank_state
    from .rank.progress import report_step
    from .wire.records import RankFailure

_LAZY = {
    "DistributedCancelledError": "errors",  # made on first use (gangrun.errors.__getattr__)
    "distributed": "api",
    "DistributedFunction": "api",
    "RunHandle": "api",
    "Options": "api",
    "RayOptions": "options",
    "ForkServerOptions": "options",
    "device": "host.accelerators",
    "backend": "host.accelerators",
    "heartbeat": "rank.heartbeat",
    "report_step": "rank.progress",
    "Checkpointer": "rank.checkpointer",
    "should_stop": "rank.checkpointer",
    "RankFailure": "records",
    "set_defaults": "defaults",
    "reset_defaults": "defaults",
    "Gang": "interactive.session",
    "rank_state": "rank.interactive",
    "load_ipython_extension": "interactive.magic",
}


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'gangrun' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{mod}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "distributed",
    "DistributedFunction",
    "RunHandle",
    "Options",
    "RayOptions",
    "ForkServerOptions",
    "device",
    "backend",
    "DistributedError",
    "LaunchError",
    "RankFailure",
    "DistributedTimeoutError",
    "DistributedCancelledError",
    "DistributedHangError",
    "DistributedPreemptedError",
    "GangError",
    "Checkpointer",
    "should_stop",
    "heartbeat",
    "report_step",
    "set_defaults",
    "reset_defaults",
    "Gang",
    "rank_state",
    "load_ipython_extension",
    "__version__",
]
