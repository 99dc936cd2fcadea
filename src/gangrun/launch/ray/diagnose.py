"""Errors of ranks on other nodes, told in the caller's terms.

Every failure of a rank on a node that does not see the caller's files names that node (its
address and Ray node id). A ``ModuleNotFoundError`` or ``FileNotFoundError`` for something
that exists on the caller's machine also says so, why it did not travel (outside what is
shipped, excluded by ``.gitignore``/``excludes``, or shipping is off) and the setting that
ships it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import pickle
import re

from ...wire.records import ErrorRecord
from .records import NodeInfo
from .ship import Manifest

_NO_MODULE = re.compile(r"No module named '([^']+)'")
_NO_FILE = re.compile(r"No such file or directory: '([^']+)'")


def node_label(info: NodeInfo | None) -> str:
    """How errors name a node (``node ? (Ray node id ?)`` when it is not known)."""
    return info.label() if info is not None else "node ? (Ray node id ?)"


def _exception(rec: ErrorRecord) -> BaseException | None:
    if not rec.exc:
        return None
    try:
        exc = pickle.loads(rec.exc)
    except Exception:  # a class that cannot be rebuilt here: the message is parsed instead
        return None
    return exc if isinstance(exc, BaseException) else None


def _module_origin(name: str) -> str | None:
    top = name.split(".", 1)[0]
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return next(iter(spec.submodule_search_locations), None)
    return spec.origin if spec.origin and os.path.exists(spec.origin) else None


def _why(path: str, manifest: Manifest | None, shipping: bool) -> str:
    if not shipping or manifest is None:
        return (
            "shipping is off (RayOptions(ship=False)); turn it on, or install/copy it on every node"
        )
    root = manifest.root_of(path)
    if root is None:
        shipped = ", ".join(r.path for r in manifest.roots) or "nothing"
        return (
            f"it is outside what gangrun ships (now: {shipped}); ship its directory with "
            f"ray=gangrun.RayOptions(paths=[{os.path.dirname(path)!r}]), move it under the "
            "working directory, or put it on storage every node reads"
        )
    if not manifest.shipped(path) and os.path.isfile(path):
        return (
            f"it is under {root.path} but excluded (.gitignore, or RayOptions(excludes=...)); "
            "un-ignore it or ship its directory with ray=gangrun.RayOptions(paths=[...])"
        )
    return "it should have shipped: report this as a gangrun bug"


def explain(
    rec: ErrorRecord,
    info: NodeInfo | None,
    manifest: Manifest | None,
    shipping: bool,
    caller_cwd: str,
    remote_cwd: str,
) -> ErrorRecord:
    """``rec`` with the node named and, for a missing module or file, the fix."""
    node = node_label(info)
    exc = _exception(rec)
    note = f"(rank {rec.rank} ran on {node}, which does not see this machine's files)"
    if rec.exc_type == "ModuleNotFoundError" or isinstance(exc, ModuleNotFoundError):
        name = getattr(exc, "name", None)
        if not name:
            m = _NO_MODULE.search(rec.message)
            name = m.group(1) if m else None
        origin = _module_origin(name) if name else None
        if origin:
            note = (
                f"module {name!r} is not on {node}, but exists on this machine at {origin}: "
                f"{_why(origin, manifest, shipping)}."
            )
    elif rec.exc_type == "FileNotFoundError" or isinstance(exc, FileNotFoundError):
        path = getattr(exc, "filename", None)
        if not isinstance(path, str):
            m = _NO_FILE.search(rec.message)
            path = m.group(1) if m else None
        if path:
            here = path
            if remote_cwd and os.path.isabs(path) and path.startswith(remote_cwd.rstrip("/") + "/"):
                here = os.path.join(caller_cwd, os.path.relpath(path, remote_cwd))
            elif not os.path.isabs(path):
                here = os.path.join(caller_cwd, path)
            if os.path.exists(here):
                note = (
                    f"{here} exists on this machine but not on {node}: "
                    f"{_why(here, manifest, shipping)}."
                )
    message = f"{rec.message}\n{note}"
    return dataclasses.replace(
        rec, message=message, traceback=f"{rec.traceback.rstrip()}\n{note}\n"
    )


__all__ = ["explain", "node_label"]
