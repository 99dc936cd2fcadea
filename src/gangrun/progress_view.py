"""What the panel, the status line and ``handle.progress()`` show of a call's progress.

Plain records and their formatting (no I/O): `Progress` for the gang and
`RankProgress` for each rank, computed by `gangrun.lifecycle.watch` from the
ranks' step reports (`gangrun.rank.progress`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .wire.memory import MemorySample, nearest_limit

NEAR_LIMIT_SHARE = 0.8  # the rank nearest its memory limit is marked from this share on


@dataclass(frozen=True)
class RankProgress:
    """One rank's progress, as the panel and the status line show it."""

    rank: int
    step: int | None = None
    total: int | None = None
    rate: float | None = None  # steps per second, recent
    slow_ratio: float | None = None  # set while the rank is slow: its rate / the others' median
    silent_for: float | None = None  # set while the rank is silent: seconds without progress
    slow_cause: str = ""  # why it is slow, from the collective record ("" unknown)


@dataclass(frozen=True)
class Progress:
    """The gang's progress: its slowest rank's step, the median rate, the ETA."""

    step: int | None = None
    total: int | None = None
    rate: float | None = None
    eta_s: float | None = None
    resumed_from: int | None = None  # the step this attempt's restore resumed at
    resumed_world: int | None = None  # the ranks that saved it, when another number
    ranks: dict[int, RankProgress] = field(default_factory=dict)
    # every live rank's last memory sample: resident memory of its tree, limit, CUDA
    memory: dict[int, MemorySample] = field(default_factory=dict)

    @property
    def reported(self) -> bool:
        return self.step is not None

    @property
    def slow(self) -> dict[int, float]:
        return {r: v.slow_ratio for r, v in self.ranks.items() if v.slow_ratio is not None}

    @property
    def silent(self) -> dict[int, float]:
        return {r: v.silent_for for r, v in self.ranks.items() if v.silent_for is not None}


def fmt_duration(s: float) -> str:
    s = max(0, int(round(s)))
    h, rest = divmod(s, 3600)
    m, sec = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{sec:02d}s" if m else f"{sec}s")


def fmt_rate(rate: float | None) -> str:
    if rate is None:
        return "-"
    return f"{rate:.3g} steps/s" if rate >= 0.1 else f"{60 * rate:.3g} steps/min"


def _slow_words(p: Progress, rank: int, ratio: float) -> str:
    cause = p.ranks[rank].slow_cause
    return f"rank {rank} ({ratio:.2f}x" + (f"; {cause})" if cause else ")")


def summary_line(p: Progress) -> str:
    """``step 120/1000 (12%) · 3.2 steps/s · ETA 4m35s · slow: rank 1 (0.45x)``, then
    ``memory: rank 1 at 93% of its limit`` once a rank is that near ('' when no rank
    reports)."""
    if p.step is None:
        return ""
    parts = [f"step {p.step}" + (f"/{p.total}" if p.total else "")]
    if p.total:
        parts[0] += f" ({100 * min(p.step, p.total) / p.total:.0f}%)"
    if p.rate is not None:
        parts.append(fmt_rate(p.rate))
    if p.eta_s is not None:
        parts.append(f"ETA {fmt_duration(p.eta_s)}")
    if p.slow:
        parts.append("slow: " + ", ".join(_slow_words(p, r, x) for r, x in sorted(p.slow.items())))
    if p.silent:
        parts.append(
            "silent: " + ", ".join(f"rank {r} ({fmt_duration(s)})" for r, s in p.silent.items())
        )
    near = nearest_limit(p.memory)
    if near is not None and (near[1].share or 0) >= NEAR_LIMIT_SHARE:
        parts.append(f"memory: rank {near[0]} at {100 * (near[1].share or 0):.0f}% of its limit")
    return " · ".join(parts)


__all__ = ["Progress", "RankProgress", "fmt_duration", "fmt_rate", "summary_line"]
