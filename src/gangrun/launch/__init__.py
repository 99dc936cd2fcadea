"""Launchers: how rank processes are started, watched and stopped.

``local`` starts fresh interpreters (``start_method="spawn"``); ``forkserver`` forks ranks from a
warm helper that imported torch but never touched CUDA; ``ray`` places ranks on a Ray cluster.

The seam to the call's lifecycle is :func:`open_gang`: it returns a :class:`Gang` for a
:class:`GangSpec`; the gang puts one :class:`RankExit` per rank into the ``events`` queue the
lifecycle owns (which also carries the lifecycle's own events: cancel, deadline, ...).
"""

from __future__ import annotations

import queue
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ..output import OutputPump


@dataclass
class RankSpec:
    rank: int
    env: dict[str, str]


@dataclass(frozen=True)
class RayPlacement:
    """Where and how a Ray gang is placed (decided by the plan, used by the Ray launcher)."""

    bundle: dict[str, float]  # resources of one rank's bundle, e.g. {"GPU": 1.0}
    strategy: str  # placement group strategy: PACK, SPREAD, STRICT_PACK, STRICT_SPREAD
    runtime_env: dict = field(default_factory=dict)
    placement_timeout: float = 300.0
    gpu_type: str | None = None  # checked against each node's accelerator
    user_omp: bool = False  # OMP_NUM_THREADS set by the user: keep it on every node


@dataclass
class GangSpec:
    run_id: str
    run_dir: str
    ranks: list[RankSpec]
    log_dir: str
    output: str = "all"
    grace_period: float = 5.0
    cwd: str = ""  # the ranks' working directory (the caller's)
    start_method: str = "auto"  # auto | spawn | forkserver (local backend)
    placement: RayPlacement | None = None  # set: the Ray backend
    extra: dict = field(default_factory=dict)  # deprecated: being replaced by typed fields


@dataclass(frozen=True)
class RankExit:
    rank: int
    exitcode: int
    time: float  # time.time() when the exit was observed


class Gang(Protocol):
    """The rank processes of one attempt of one call."""

    pids: dict[int, int]  # rank -> pid of the rank's process

    def start(self) -> None: ...

    def alive(self) -> list[int]: ...

    def stop(self, grace: float | None = None) -> None:
        """SIGTERM every rank's tree, wait up to ``grace``, SIGKILL what is left, sweep."""

    def reap_leftovers(self) -> None:
        """Kill whatever is left of the ranks' trees (descendants included)."""

    def close(self) -> None:
        """Release pipes, threads and log files (after the ranks are gone)."""


def open_gang(spec: GangSpec, pump: OutputPump, events: queue.Queue) -> Gang:
    """The gang for ``spec``: Ray actors when ``spec.placement`` is set, else fork server or
    fresh interpreters by ``spec.start_method``. Exits go into ``events``."""
    gang: Gang
    if spec.placement is not None:
        from .ray import RayGang

        gang = RayGang(spec, pump)
    else:
        from .forkserver import launcher_for

        gang = launcher_for(spec.start_method)(spec, pump)
    gang.exits = events  # type: ignore[attr-defined]  # transitional: gangs take `events`
    return gang
