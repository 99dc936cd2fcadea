"""(1) Relaunch latency, warm parent, 2 ranks, a function that imports torch.

gangrun cold (a new fork server each time) and warm, gangrun with start_method="spawn",
``torch.multiprocessing.spawn``, ``elastic_launch`` (torchrun's engine) and Accelerate's
``notebook_launcher`` (which forks this process: it has imported torch, never CUDA).
Methods are interleaved within each repetition so that machine noise hits all of them alike.
"""

from __future__ import annotations

import time
import uuid

import workloads
from _common import free_port, main, ratio, summary, timed


def run(reps: int) -> dict:
    import torch  # the warm parent, like a notebook that imported torch (never CUDA)
    import torch.multiprocessing as mp
    from accelerate import notebook_launcher
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from gangrun import distributed
    from gangrun.launch import forkserver

    assert not torch.cuda.is_initialized()
    opts = dict(processes=2, mlflow=False, timeout=300)
    g_fork = distributed(**opts, start_method="forkserver")(workloads.relaunch_fn)
    g_spawn = distributed(**opts, start_method="spawn")(workloads.relaunch_fn)

    def cold():
        forkserver.discard_server()
        return g_fork.distributed()

    def elastic():
        cfg = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=2,
            run_id=uuid.uuid4().hex,
            rdzv_backend="c10d",
            rdzv_endpoint=f"127.0.0.1:{free_port()}",
            max_restarts=0,
            monitor_interval=0.1,
        )
        return elastic_launch(cfg, workloads.relaunch_fn)()

    methods = {
        "gangrun_cold": cold,
        "gangrun_warm": g_fork.distributed,
        "gangrun_spawn": g_spawn.distributed,
        "mp_spawn": lambda: mp.spawn(workloads.relaunch_spawn, nprocs=2, join=True),
        "elastic_launch": elastic,
        "accelerate_notebook_launcher": lambda: notebook_launcher(
            workloads.relaunch_fn, (), num_processes=2, use_port=str(free_port())
        ),
    }
    g_fork.distributed()  # the warm state: a server exists
    times: dict[str, list[float]] = {k: [] for k in methods}
    for _ in range(reps):
        for name, fn in methods.items():
            dt, _ = timed(fn)
            times[name].append(dt)
            time.sleep(0.2)  # a notebook user does not relaunch within microseconds
    med = {k: summary(v) for k, v in times.items()}
    m = {k: v["median"] for k, v in med.items()}
    return {
        "name": "relaunch",
        "unit": "s",
        "results": med,
        "ratios": {
            "warm_vs_mp_spawn": ratio(m["gangrun_warm"], m["mp_spawn"]),
            "warm_vs_accelerate": ratio(m["gangrun_warm"], m["accelerate_notebook_launcher"]),
            "warm_vs_elastic_launch": ratio(m["gangrun_warm"], m["elastic_launch"]),
            "cold_vs_mp_spawn": ratio(m["gangrun_cold"], m["mp_spawn"]),
            "spawn_vs_mp_spawn": ratio(m["gangrun_spawn"], m["mp_spawn"]),
        },
    }


if __name__ == "__main__":
    main(run)
