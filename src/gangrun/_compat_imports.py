"""Guarded imports of private names of torch, Ray and MLflow.

A private module (``torch.distributed.checkpoint._fsspec_filesystem``,
``ray._private...``) can move or vanish in any release. Importing it through
`private_import` turns that into an ``ImportError`` that says what is missing, which
version is installed and which versions gangrun supports, instead of a bare
``ModuleNotFoundError`` deep inside a rank.
"""

from __future__ import annotations

import importlib
from typing import Any

from .errors import PrivateImportError

TORCH_SUPPORTED = "torch>=2.4,<=2.13"
RAY_SUPPORTED = "ray>=2.9,<=2.60"
MLFLOW_SUPPORTED = "mlflow>=2.10,<=3.17"

_EXTRA = {"torch": "torch", "ray": "ray", "mlflow": "mlflow"}


def _installed(dist: str) -> str | None:
    try:
        import importlib.metadata as md

        return md.version(dist)
    except Exception:  # not installed, or no metadata (a source checkout)
        return None


def private_import(module: str, attr: str | None = None, *, supported: str) -> Any:
    """Import ``module`` (and return ``module.attr`` when given), or raise a clear error.

    ``supported`` names the versions gangrun is tested with, e.g. ``"torch>=2.4,<=2.13"``.
    Raises [`PrivateImportError`][gangrun.errors.PrivateImportError] (an ``ImportError``) when the library is absent or the
    private name is not in the installed version.
    """
    top = module.split(".", 1)[0]
    what = f"{module}.{attr}" if attr else module
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        if exc.name == top:  # the library itself is not installed
            raise PrivateImportError(
                f"gangrun needs {top} for this feature, and it is not installed. "
                f"Install a supported version ({supported}), e.g. "
                f'pip install "gangrun[{_EXTRA.get(top, top)}]".'
            ) from exc
        raise _unsupported(what, top, supported) from exc
    if attr is None:
        return mod
    try:
        return getattr(mod, attr)
    except AttributeError as exc:
        raise _unsupported(what, top, supported) from exc


def _unsupported(what: str, top: str, supported: str) -> PrivateImportError:
    version = _installed(top) or "of unknown version"
    return PrivateImportError(
        f"gangrun uses {what}, which the installed {top} {version} does not have (a private "
        f"name that moved between releases). gangrun supports {supported}: install one of "
        f'those (e.g. pip install "{supported}"), or report this {top} version to gangrun.'
    )


__all__ = [
    "private_import",
    "PrivateImportError",
    "TORCH_SUPPORTED",
    "RAY_SUPPORTED",
    "MLFLOW_SUPPORTED",
]
