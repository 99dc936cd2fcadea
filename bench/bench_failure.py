"""(2) Failure surfacing: rank 1 raises while rank 0 blocks in a gloo all_reduce.

Latency = when the caller holds the exception - when rank 1 raised (rank 1 writes the time).
"""

from __future__ import annotations

import glob
import os
import tempfile
import time

import workloads
from _common import elastic_config, free_port, interleaved, main, report


def _raised_at(d: str) -> float:
    files = glob.glob(os.path.join(d, "raised.*"))
    assert files, "rank 1 did not record its failure"
    with open(files[0]) as f:
        return float(f.read())


def run(reps: int) -> dict:
    import torch.multiprocessing as mp
    from torch.distributed.launcher.api import elastic_launch

    from gangrun import DistributedError, distributed

    g = distributed(processes=2, mlflow=False, timeout=120, start_method="forkserver")(
        workloads.failing
    )

    gs = g.options(start_method="spawn")  # fresh interpreters: the core path alone

    def gangrun_(d, fn=g):
        try:
            fn.distributed(d)
        except DistributedError as e:
            assert e.rank == 1, e
            return
        raise AssertionError("no failure surfaced")

    def gangrun_spawn(d):
        gangrun_(d, gs)

    def mp_spawn(d):
        try:
            mp.spawn(workloads.failing_spawn, args=(d, free_port()), nprocs=2, join=True)
        except Exception:
            return
        raise AssertionError("no failure surfaced")

    def elastic(d):
        cfg = elastic_config()
        try:
            elastic_launch(cfg, workloads.failing)(d)
        except Exception:
            return
        raise AssertionError("no failure surfaced")

    methods = {
        "gangrun": gangrun_,
        "gangrun_spawn": gangrun_spawn,
        "mp_spawn": mp_spawn,
        "elastic_launch": elastic,
    }
    g.distributed  # noqa: B018
    with tempfile.TemporaryDirectory() as d0:  # warm the fork server
        gangrun_(d0)

    def latency(fn) -> float:
        with tempfile.TemporaryDirectory() as d:
            fn(d)
            return time.time() - _raised_at(d)

    times = interleaved(reps, {k: (lambda fn=fn: latency(fn)) for k, fn in methods.items()})
    return report(
        "failure",
        times,
        {
            "gangrun_vs_mp_spawn": ("gangrun", "mp_spawn"),
            "gangrun_vs_elastic_launch": ("gangrun", "elastic_launch"),
            "gangrun_spawn_vs_mp_spawn": ("gangrun_spawn", "mp_spawn"),
        },
    )


if __name__ == "__main__":
    main(run)
