"""The seams between a call and the notebook: what ``submit()`` and the decorator call.

`wiring` runs in ``submit()`` (the launching cell's thread), before the call's supervisor is
made: in a kernel it gives the call its stdout/stderr bound to that cell and, unless turned
off, the live panel as one of its observers (`gangrun.notebook.panel.Panel`). Outside a
kernel it gives nothing: the call writes to ``sys.stdout``/``sys.stderr``.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from ..lifecycle.observers import Wiring
from . import kernel

if TYPE_CHECKING:
    from ..options import Options


def panel_wanted(opts: Options) -> bool:
    return opts.progress and opts.output != "none"


def wiring(opts: Options) -> Wiring:
    """In a kernel: the call's output goes to the launching cell, a live panel observes it,
    and it is a kernel's call; outside one: nothing (the supervisor's defaults)."""
    if kernel() is None:
        return {}
    from .routing import cell_writer, current_parent

    wired: Wiring = {
        "stdout": cell_writer(sys.stdout),
        "stderr": cell_writer(sys.stderr),
        "caller": "kernel",
    }
    if not panel_wanted(opts):
        return wired
    from IPython import get_ipython

    from .panel import Panel

    shell = get_ipython()
    parent = current_parent(getattr(shell, "display_pub", None)) or current_parent(sys.stdout)
    wired["observers"] = [Panel(shell, parent)]
    return wired


def on_decorate(opts: Options) -> None:
    """A function was decorated: in a kernel, warm the fork server for its first call."""
    if opts.backend != "local" or opts.start_method == "spawn":
        return
    if kernel() is None:
        return
    from .warm import prewarm_soon

    prewarm_soon(opts.forkserver)


__all__ = ["wiring", "on_decorate", "panel_wanted"]
