"""`OptionKwargs`: every field of `Options` as a keyword argument, typed, for the signatures
of ``@distributed(...)`` and ``.options(...)`` (``**options: Unpack[OptionKwargs]``): a type
checker sees a misspelled option or a wrong type at the call site.

``tests/unit/test_option_kwargs.py`` holds it to ``dataclasses.fields(Options)``: the same
keys, the same types (where a keyword accepts more than the field stores, the test names it).
Imported by the API only when type checking.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, TypedDict

from .options import ForkServerOptions, RayOptions


class OptionKwargs(TypedDict, total=False):
    """The keyword arguments of ``@distributed(...)``; see `gangrun.Options` for each."""

    gpus: int | list[int] | None
    processes: int | None
    gpu_type: str | None
    timeout: float | str | None  # seconds, or a duration as text: "10m", "1h30m", "none"
    mlflow: bool
    env: Mapping[str, str] | None  # None: no extra variables
    max_restarts: int
    min_ranks: int | None
    output: Literal["all", "rank0", "none"]
    max_capture_bytes: int | None
    grace_period: float | str
    log_dir: str | None
    start_method: Literal["auto", "spawn", "forkserver"]
    backend: Literal["local", "ray"]
    address: str | None
    ray: RayOptions | Mapping[str, Any]  # a dict of RayOptions' fields is accepted
    forkserver: ForkServerOptions | Mapping[str, Any]  # likewise
    log_system_metrics: bool | None
    experiment_name: str | None
    run_name: str | None
    run_id: str | None
    tags: Mapping[str, str] | None  # None: no tags
    hang_timeout: float | str | None
    gpu_wait: float | str | None
    progress: bool
    restart_backoff: float | str
    restart_backoff_max: float | str
    checkpoint_dir: str | None
    memory: bool
    memory_every: int | None


__all__ = ["OptionKwargs"]
