"""Ranks forked from a warm helper: fork speed without forking the caller.

The fork server is a helper process started lazily by the first launch (per start-up
signature: see `client`). It imports the heavy modules (the ``forkserver`` option's
``preload``: default ``torch``, or ``GANGRUN_PRELOAD``, comma-separated, ``none`` for
nothing) and never initialises CUDA, then waits on a private unix socket pair. For each launch the caller sends the ranks' environments together
with each rank's stdout/stderr pipe ends, the caller's liveness pipe and a per-rank status pipe
(``SCM_RIGHTS``, `protocol`); the server (`server`) forks one child per rank and
answers with the pids; each child becomes a rank (`child`).

If the caller dies, its ranks see their liveness pipe close (as with spawned ranks) and the
server sees its control socket close and exits. If the server dies, every rank it forked sees
the server's own liveness pipe close and kills its tree; the next launch starts a new server.
When the server cannot be started, the launch falls back to fresh interpreters (chosen in
`gangrun.launch.gang.choose_spawner`); ``auto`` calls try the server again after a back-off
(`client.Registry.retry_in`).

Modules: ``protocol`` (typed messages, framing), ``server`` (the server process), ``child`` (a
forked child becoming a rank), ``client`` (the caller's handles and the per-signature
registry), ``spawner`` (the `Spawner`).
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any

from .client import registry, startup_signature, usable

if TYPE_CHECKING:
    from ...options import ForkServerOptions


def server_info() -> dict[str, Any] | None:
    """What the most recently used fork server reports about itself (pid, preloaded
    modules, whether CUDA is initialised in it), or ``None`` when none is running."""
    s = registry.current()
    if s is None:
        return None
    try:
        return dataclasses.asdict(s.server_info())
    except Exception:  # it died meanwhile: as if none were running
        return None


def prewarm(pool: int = 2, settings: ForkServerOptions | None = None) -> None:
    """Start the fork server for this process's start-up environment now (a notebook does
    this when a function is decorated, with that function's ``forkserver`` option), so the
    first call finds it warm. Not while a failed start's back-off lasts."""
    if registry.retry_in() > 0:
        return
    server = registry.lease(startup_signature(dict(os.environ)), pool, settings)
    registry.release(server)


def discard_server() -> None:
    """Stop every idle or running fork server: the next launch starts a new one."""
    registry.close_all(0.5)


__all__ = ["server_info", "prewarm", "discard_server", "registry", "startup_signature", "usable"]
