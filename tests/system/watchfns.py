"""Rank functions of the watching tests (imported by reference in the ranks)."""

from __future__ import annotations

import os
import time

import gangrun


def spin_until(flag: str, limit_s: float = 60.0) -> int:
    """Report steps until ``flag`` exists (each rank), then return the rank."""
    rank = int(os.environ["RANK"])
    deadline = time.monotonic() + limit_s
    step = 0
    while not os.path.exists(flag) and time.monotonic() < deadline:
        step += 1
        gangrun.report_step(step)
        time.sleep(0.02)
    return rank


def uneven(steps: int, slow_rank: int = 1, fast_s: float = 0.005, slow_s: float = 0.05) -> int:
    """Every rank reports ``steps`` steps; ``slow_rank`` sleeps 10x longer in each."""
    rank = int(os.environ["RANK"])
    for step in range(1, steps + 1):
        time.sleep(slow_s if rank == slow_rank else fast_s)
        gangrun.report_step(step, steps)
    return rank


def fail_on(rank_to_fail: int, code: int = 3) -> int:
    rank = int(os.environ["RANK"])
    if rank == rank_to_fail:
        time.sleep(0.2)
        raise SystemExit(code)
    time.sleep(30)
    return rank


def holds_memory(mib: int, seconds: float) -> int:
    """Rank 1 holds ``mib`` MiB more (written: resident) for ``seconds``; rank 0 only waits."""
    held = b"\x01" * (mib << 20) if os.environ["RANK"] == "1" else b""
    time.sleep(seconds)
    return len(held)
