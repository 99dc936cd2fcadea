"""(1) Relaunch latency, warm parent, 2 ranks, a function that imports torch.

gangrun cold (a new fork server each time) and warm, gangrun with start_method="spawn",
``torch.multiprocessing.spawn``, ``elastic_launch`` (torchrun's engine) and Accelerate's
``notebook_launcher`` (which forks this process: it has imported torch, never CUDA).
Methods are interleaved within each repetition so that machine noise hits all of them alike.
"""

from __future__ import annotations

import workloads
from _common import elastic_config, free_port, interleaved, main, report, timed


def run(reps: int) -> dict:
    import torch  # the warm parent, like a notebook that imported torch (never CUDA)
    import torch.multiprocessing as mp
    from accelerate import notebook_launcher
    from torch.distributed.launcher.api import elastic_launch

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
        cfg = elastic_config()
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
    times = interleaved(reps, {k: (lambda fn=fn: timed(fn)[0]) for k, fn in methods.items()})
    return report(
        "relaunch",
        times,
        {
            "warm_vs_mp_spawn": ("gangrun_warm", "mp_spawn"),
            "warm_vs_accelerate": ("gangrun_warm", "accelerate_notebook_launcher"),
            "warm_vs_elastic_launch": ("gangrun_warm", "elastic_launch"),
            "cold_vs_mp_spawn": ("gangrun_cold", "mp_spawn"),
            "spawn_vs_mp_spawn": ("gangrun_spawn", "mp_spawn"),
        },
    )


if __name__ == "__main__":
    main(run)
