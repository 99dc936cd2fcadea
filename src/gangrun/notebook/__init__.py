"""The notebook experience: output routed to the launching cell, a live panel, the user's
source in rank tracebacks, mistakes caught before launch, and a warm first call.

Nothing here imports IPython or ipykernel unless this process already runs in a kernel
(`in_kernel`), so ``import gangrun`` stays cheap and scripts never pay for it.
"""

from __future__ import annotations

import sys
from typing import Any

from .. import errors


def kernel() -> Any:
    """The running ipykernel kernel object, or ``None`` outside a Jupyter kernel."""
    if "ipykernel" not in sys.modules or "IPython" not in sys.modules:
        return None  # never import IPython ourselves: a script must not pay for it
    try:
        from IPython import get_ipython

        shell = get_ipython()
    except Exception:  # a broken IPython install: behave as outside a kernel
        return None
    return getattr(shell, "kernel", None) if shell is not None else None


def in_kernel() -> bool:
    return kernel() is not None


def error_html(err: errors.DistributedError) -> str:
    """An error's HTML form (its ``_repr_html_``): `html.error_html`, imported on first use."""
    from .html import error_html as render

    return render(err)


errors.register_html(error_html)  # errors.py imports nothing above it: it is told here

__all__ = ["kernel", "in_kernel", "error_html"]
