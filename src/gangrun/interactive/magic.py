"""The Jupyter extension: ``%load_ext gangrun``, then cells starting with ``%%distributed g``.

The cell runs through ``g.execute`` (``%%distributed`` alone: the gang created last), rank
output streams into the cell, and the per-rank values are the cell's result. The gangs of the
kernel are closed when it shuts down (interpreter exit; the liveness pipe if it is killed).
"""

from __future__ import annotations

from typing import Any


def _distributed(line: str, cell: str) -> Any:
    __tracebackhide__ = True  # IPython: the cell's error, not the magic's frames
    from IPython import get_ipython

    from .session import Gang, last_gang

    name = line.strip()
    if name:
        ip = get_ipython()
        ns = ip.user_ns if ip is not None else {}
        try:
            g = eval(name, ns)  # a name or an expression such as gangs["a"]
        except Exception as exc:
            raise NameError(
                f"%%distributed {name}: {type(exc).__name__}: {exc}. Create the gang first, "
                f"e.g. {name} = gangrun.Gang(processes=2)."
            ) from None
        if not isinstance(g, Gang):
            raise TypeError(f"%%distributed {name}: {name} is a {type(g).__name__}, not a Gang.")
    else:
        g = last_gang()
        if g is None:
            raise RuntimeError(
                "%%distributed: no gang yet. Create one first, e.g. g = gangrun.Gang(processes=2), "
                "or name it: %%distributed g."
            )
    values = g.execute(cell)
    if all(v is None for v in values):
        return None
    return values


def load_ipython_extension(ipython: Any) -> None:
    """Register the ``%%distributed`` cell magic (``%load_ext gangrun``)."""
    ipython.register_magic_function(_distributed, "cell", "distributed")


def unload_ipython_extension(ipython: Any) -> None:
    ipython.magics_manager.magics["cell"].pop("distributed", None)
