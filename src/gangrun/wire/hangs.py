"""The hang verdict's record: where each rank was when a call was found hung (or ran out of
time), carried by [`DistributedHangError`][gangrun.errors.DistributedHangError] as ``err.hang``
and by [`DistributedTimeoutError`][gangrun.errors.DistributedTimeoutError] as ``err.where``.
Made by the caller (`gangrun.lifecycle.verdict`); plain frozen data, so the error pickles."""

from __future__ import annotations

from dataclasses import dataclass

from .collectives import OpRecord


@dataclass(frozen=True)
class RankPlace:
    """Where one rank was."""

    rank: int
    site: str  # its innermost frame in user code, "path:line" ("" unknown)
    words: str  # e.g. "in all_reduce number 12 at train.py:38, for 11s"
    op: OpRecord | None = None  # the torch.distributed op it was inside, if any
    quiet: float = 0.0  # seconds without progress
    stopped: bool = False  # stopped by a signal (SIGSTOP)


@dataclass(frozen=True)
class Hang:
    """A hang: ``holders`` keep ``waiters`` waiting in ``op`` since ``waited`` seconds."""

    kind: str  # "not entered", "mismatch", "never initialized", "stopped"
    holders: tuple[int, ...]
    waiters: tuple[int, ...]
    op: OpRecord  # the collective (or rendezvous) the waiters are in
    waited: float
    timeout: float  # T
    places: tuple[RankPlace, ...]

    def place(self, rank: int) -> RankPlace | None:
        for p in self.places:
            if p.rank == rank:
                return p
        return None


__all__ = ["Hang", "RankPlace"]
