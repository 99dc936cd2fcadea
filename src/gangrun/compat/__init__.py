"""Compatibility helpers for code written for other launchers and frameworks.

``TorchDistributor`` (Spark's API, imported lazily) lives in `torch_distributor`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TorchDistributor"]


def __getattr__(name: str) -> Any:
    if name == "TorchDistributor":
        from .torch_distributor import TorchDistributor

        return TorchDistributor
    raise AttributeError(f"module 'gangrun.compat' has no attribute {name!r}")
