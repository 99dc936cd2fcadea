"""The one error module: every exception gangrun raises to its callers.

They are defined in `gangrun.wire.errors` (they cross process boundaries, and the formats of
`gangrun.wire` raise them); this is where users import them from, and the path their
``__module__``, tracebacks and pickles name.
"""

from __future__ import annotations

from .wire import errors as _defined
from .wire.errors import (
    PEER_ECHO_TEXT,
    DistributedError,
    DistributedHangError,
    DistributedPreemptedError,
    DistributedTimeoutError,
    GangError,
    LaunchError,
    PrivateImportError,
    register_html,
    signal_name,
)

TYPE_CHECKING = False  # not typing's: importing typing is most of `import gangrun`'s time
if TYPE_CHECKING:
    from .wire.errors import DistributedCancelledError


def __getattr__(name: str) -> type:
    """`DistributedCancelledError`, made on first use (see `gangrun.wire.errors`)."""
    value: type = getattr(_defined, name)  # AttributeError for any other name
    if name != "DistributedCancelledError":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


__all__ = [
    "DistributedError",
    "LaunchError",
    "DistributedTimeoutError",
    "DistributedCancelledError",
    "DistributedHangError",
    "DistributedPreemptedError",
    "GangError",
    "PrivateImportError",
    "PEER_ECHO_TEXT",
    "register_html",
    "signal_name",
]
