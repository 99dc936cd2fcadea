"""Which failed rank is the root cause.

A rank killed by a signal (SIGKILL, SIGSEGV, ``os._exit``) leaves no error record; the caller
only learns of it when its ``waitpid`` thread runs, which on a busy machine can be *after* a
peer blocked in a collective has noticed the closed connection, raised, and written an error
record with an earlier timestamp. Sorting by time alone then blames the peer (measured: 7 of 8
runs with a SIGKILLed rank and a peer inside ``all_reduce``). So errors that are the *echo* of
a peer's death (gloo/NCCL/store connection errors) rank behind every other failure.
"""

from __future__ import annotations

import re
import signal
from typing import Any

_PEER_ECHO = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|"
    r"remote worker crash|remote process exited|NCCL communicator was aborted|"
    r"ProcessGroupGloo.*(?:Timed out|closed)|DistNetworkError|DistStoreError|"
    r"recvValue failed|Socket Timeout|Connection refused",
    re.IGNORECASE,
)


def is_peer_echo(rec: dict[str, Any] | None) -> bool:
    """The rank failed because a peer went away (not a cause of its own)."""
    if not rec:
        return False
    text = f"{rec.get('exc_type', '')}: {rec.get('message', '')}"
    return bool(_PEER_ECHO.search(text))


def pick(
    candidates: list[tuple[float, int, Any, dict[str, Any] | None]],
    late: list[tuple[float, int, Any, dict[str, Any] | None]],
) -> tuple[float, int, Any, dict[str, Any] | None]:
    """The root cause among ``(time, rank, exit, record)`` candidates (failures before the
    teardown). ``late``: record-less deaths seen just after the teardown began that were not
    caused by it (not SIGTERM); they are only preferred over peer echoes."""
    own = [c for c in candidates if not is_peer_echo(c[3])]
    if own:
        return min(own, key=lambda c: (c[0], c[1]))
    late = [c for c in late if c[2].exitcode != -signal.SIGTERM]
    if late:
        return min(late, key=lambda c: (c[0], c[1]))
    return min(candidates, key=lambda c: (c[0], c[1]))
