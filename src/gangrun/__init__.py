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
    from .host.accelerators import accelerators, backend, device
    from .interactive.magic import load_ipython_extension
    from .interactive.session import Gang
    from .options import ForkServerOptions, RayOptions
    from .rank.checkpointer import Checkpointer, should_stop
    from .rank.heartbeat import heartbeat
    from .rank.interactive import rank_state
    from .rank.progress import report_step
    from .wire.records import RankFailure

# Every lazily loaded name and the module that defines it (full paths: tests/unit/test_layers.py
# reads them as imports of this module, tests/unit/test_public_names.py resolves them).
_LAZY = {
    "DistributedCancelledError": "gangrun.errors",  # made on first use (its __getattr__)
    "distributed": "gangrun.api",
    "DistributedFunction": "gangrun.api",
    "RunHandle": "gangrun.api",
    "Options": "gangrun.api",
    "RayOptions": "gangrun.options",
    "ForkServerOptions": "gangrun.options",
    "accelerators": "gangrun.host.accelerators",
    "device": "gangrun.host.accelerators",
    "backend": "gangrun.host.accelerators",
    "heartbeat": "gangrun.rank.heartbeat",
    "report_step": "gangrun.rank.progress",
    "Checkpointer": "gangrun.rank.checkpointer",
    "should_stop": "gangrun.rank.checkpointer",
    "RankFailure": "gangrun.wire.records",
    "set_defaults": "gangrun.defaults",
    "reset_defaults": "gangrun.defaults",
    "Gang": "gangrun.interactive.session",
    "rank_state": "gangrun.rank.interactive",
    "load_ipython_extension": "gangrun.interactive.magic",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'gangrun' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
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
    "accelerators",
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
