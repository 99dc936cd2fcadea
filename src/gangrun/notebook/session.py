"""The seams between a call and the notebook: what ``submit()`` and the decorator call.

:func:`attach` runs in ``submit()`` (the launching cell's thread): in a kernel it binds the
call's stdout/stderr to that cell and, unless turned off, gives the call a :class:`CallState`
whose observer is the live panel. Outside a kernel it does nothing.
"""

from __future__ import annotations

import sys
from typing import Any

from . import kernel


def panel_wanted(opts: Any) -> bool:
    return bool(getattr(opts, "progress", True)) and getattr(opts, "output", "all") != "none"


def attach(run: Any, opts: Any) -> Any:
    """Route ``run``'s output to the launching cell; return its ``CallState`` (or ``None``)."""
    k = kernel()
    if k is None:
        return None
    from .routing import cell_writer, current_parent

    if run.stdout is sys.stdout:
        run.stdout = cell_writer(sys.stdout)
    if run.stderr is sys.stderr:
        run.stderr = cell_writer(sys.stderr)
    if not panel_wanted(opts):
        return None
    from IPython import get_ipython

    from .panel import Panel
    from .state import CallState

    shell = get_ipython()
    parent = current_parent(getattr(shell, "display_pub", None)) or current_parent(sys.stdout)
    state = CallState(run.fn_name, run.run_id, opts.max_restarts, [Panel(shell, parent)])
    run.progress = state
    return state


def on_decorate(opts: Any) -> None:
    """A function was decorated: in a kernel, warm the fork server for its first call."""
    if getattr(opts, "backend", "local") != "local" or getattr(opts, "start_method", "") == "spawn":
        return
    if kernel() is None:
        return
    from .warm import prewarm_soon

    prewarm_soon()


__all__ = ["attach", "on_decorate", "panel_wanted"]
