"""Launchers: how rank processes are started, watched and stopped.

``local`` starts fresh interpreters (``start_method="spawn"``); ``forkserver`` forks ranks from a
warm helper that imported torch but never touched CUDA; ``ray`` places ranks on a Ray cluster.
All of them hand rank exits to the run as ``(rank, exitcode, time)`` events.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RankSpec:
    rank: int
    env: dict[str, str]


@dataclass
class GangSpec:
    run_id: str
    run_dir: str
    ranks: list[RankSpec]
    log_dir: str
    output: str = "all"
    grace_period: float = 5.0
    extra: dict = field(default_factory=dict)


@dataclass
class RankExit:
    rank: int
    exitcode: int
    time: float  # time.time() when the exit was observed
