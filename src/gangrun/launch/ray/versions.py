"""Versions checked at placement: each node's Python, gangrun and torch against the caller's.

A different major/minor version (or torch missing on a node where the caller has it) is a
[`LaunchError`][gangrun.errors.LaunchError] before the function runs: pickled code and tensors do
not reliably cross such a gap, and the failure would otherwise surface as an obscure
unpickling error on one rank. A different patch version (or build tag: ``+cpu``/``+cu124``)
is a warning.
"""

from __future__ import annotations

import importlib.metadata as md
import re
import sys
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING

from ...errors import LaunchError

if TYPE_CHECKING:
    from .records import NodeInfo

CHECKED = ("python", "gangrun", "torch")


def local_versions() -> dict[str, str | None]:
    """This process's versions (no heavy import: torch's comes from its metadata)."""
    from ...version import __version__

    try:
        torch: str | None = md.version("torch")
    except md.PackageNotFoundError:
        torch = None
    return {"python": sys.version.split()[0], "gangrun": __version__, "torch": torch}


def _split(v: str) -> tuple[tuple[str, ...], str]:
    base, _, tag = v.partition("+")
    parts = tuple(re.split(r"[.]", base))
    return parts, tag


def compare(mine: str | None, theirs: str | None) -> str:
    """``"same"``, ``"patch"`` (differs after major.minor, or in the build tag) or ``"major"``."""
    if mine == theirs:
        return "same"
    if mine is None or theirs is None:
        return "major" if mine is not None else "same"  # the caller does not use it
    (a, ta), (b, tb) = _split(mine), _split(theirs)
    if a[:2] != b[:2]:
        return "major"
    return "patch" if (a, ta) != (b, tb) else "same"


def check(nodes: Mapping[int, NodeInfo], mine: dict[str, str | None] | None = None) -> None:
    """Raise for a major/minor mismatch on any node, warn for patch-level differences."""
    mine = local_versions() if mine is None else mine
    errors: list[str] = []
    notes: list[str] = []
    seen: set[tuple[str, str]] = set()
    for r in sorted(nodes):
        info = nodes[r]
        theirs = info.versions
        node = info.label()
        for name in CHECKED:
            key = (info.node_id, name)
            if key in seen:
                continue
            seen.add(key)
            got = theirs.get(name)
            how = compare(mine.get(name), got)
            line = f"{name} {got or 'not installed'} on {node} vs {mine.get(name)} here"
            if how == "major":
                errors.append(line)
            elif how == "patch":
                notes.append(line)
    if errors:
        raise LaunchError(
            "The Ray cluster's nodes run other versions than this process; the function was "
            "not started:\n  "
            + "\n  ".join(errors)
            + "\nInstall the same versions on every node (e.g. one image for the cluster and "
            "the notebook), or connect from an environment that matches the cluster."
        )
    if notes:
        warnings.warn(
            "gangrun: patch-level version differences with the Ray cluster's nodes: "
            + "; ".join(notes),
            RuntimeWarning,
            stacklevel=2,
        )


__all__ = ["local_versions", "compare", "check"]
