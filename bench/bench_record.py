"""The cost of the collective record (the hang verdict's rank half): 2 gloo ranks, blocks of
``STEPS`` tiny ``all_reduce`` steps (one float32), the recorded ``dist.all_reduce`` against the
unrecorded one (``dist.all_reduce.__wrapped__``, the function gangrun wrapped), in the same
ranks, interleaved block by block (on, off, off, on, ...) so drift and load hit both alike.

Reported: the ratio recorded / unrecorded three ways (medians of the blocks, the median of
each adjacent on/off pair's ratio, the fastest blocks), and the noise: the same pair ratio
between unrecorded blocks alone (what a ratio of 1 looks like on this machine now); and the
recorded call's cost alone, in one rank of a world of one (no peer to wait for).
Run: ``PYTHONPATH=src python bench/bench_record.py --reps 12`` (blocks per side).
"""

from __future__ import annotations

import statistics

from _common import main

STEPS = 1000


def blocks(reps: int, steps: int) -> dict[str, list[float]]:
    """Runs on every rank: ``reps`` blocks of each kind; rank 0's block times."""
    import time

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    recorded = dist.all_reduce
    plain = getattr(recorded, "__wrapped__", None)
    assert plain is not None, "dist.all_reduce is not recorded in this rank"
    t = torch.ones(1)
    for _ in range(200):  # warm up both paths
        recorded(t)
        plain(t)
    out: dict[str, list[float]] = {"on": [], "off": []}
    for i in range(reps):
        order = ("on", "off") if i % 2 == 0 else ("off", "on")
        for kind in order:
            fn = recorded if kind == "on" else plain
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(steps):
                fn(t)
            out[kind].append(time.perf_counter() - t0)
    dist.destroy_process_group()
    return out


def alone(reps: int, steps: int) -> dict[str, float]:
    """In a world of one: microseconds per call, recorded and not (the fastest block)."""
    import time

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    recorded, t = dist.all_reduce, torch.ones(1)
    plain = recorded.__wrapped__
    best = {"on": float("inf"), "off": float("inf")}
    for _ in range(reps):
        for kind, fn in (("on", recorded), ("off", plain)):
            t0 = time.perf_counter()
            for _ in range(steps):
                fn(t)
            best[kind] = min(best[kind], (time.perf_counter() - t0) / steps * 1e6)
    dist.destroy_process_group()
    return best


def _pairs(a: list[float], b: list[float]) -> float:
    return statistics.median(x / y for x, y in zip(a, b, strict=False))


def run(reps: int) -> dict:
    from gangrun import distributed

    fn = distributed(processes=2, mlflow=False, timeout=1800)(blocks)
    res = fn.distributed(reps, STEPS)[0]
    on, off = res["on"], res["off"]
    one = distributed(processes=1, mlflow=False, timeout=600)(alone).distributed(reps, STEPS)[0]
    return {
        "name": "record",
        "steps_per_block": STEPS,
        "blocks_per_side": reps,
        "on": {"median": statistics.median(on), "samples": on},
        "off": {"median": statistics.median(off), "samples": off},
        "ratio_of_medians": statistics.median(on) / statistics.median(off),
        "ratio_median_of_pairs": _pairs(on, off),
        "ratio_of_fastest": min(on) / min(off),
        "noise_off_pairs": _pairs(off[1:], off[:-1]),
        "per_step_us": {
            "on": 1e6 * statistics.median(on) / STEPS,
            "off": 1e6 * statistics.median(off) / STEPS,
        },
        "world_of_one_us": one,
        "record_cost_us": one["on"] - one["off"],
    }


if __name__ == "__main__":
    main(run, default_reps=12)
