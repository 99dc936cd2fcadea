"""(3) DDP training throughput (steps/s) of the same script under gangrun and ``torchrun``.

Both get the same ``OMP_NUM_THREADS`` (the node's cores divided by the ranks, gangrun's own
default; torchrun would otherwise force 1). Runs alternate between the two launchers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import ddp_train
from _common import BENCH, main, ratio, summary

STEPS = int(os.environ.get("BENCH_DDP_STEPS", "60"))


def run(reps: int) -> dict:
    from gangrun import distributed

    cores = len(os.sched_getaffinity(0))
    threads = str(max(1, cores // 2))
    g = distributed(
        processes=2, mlflow=False, timeout=600, output="none", env={"OMP_NUM_THREADS": threads}
    )(ddp_train.train)

    def torchrun() -> float:
        env = dict(os.environ, OMP_NUM_THREADS=threads)
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node=2",
                os.path.join(BENCH, "ddp_train.py"),
                str(STEPS),
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            check=True,
        ).stdout
        line = [x for x in out.splitlines() if x.startswith("RESULT ")][-1]
        res = json.loads(line[len("RESULT ") :])
        assert res["threads"] == int(threads), res
        return float(res["steps_per_s"])

    def gangrun_() -> float:
        res = g.distributed(STEPS)
        assert res[0]["threads"] == int(threads), res
        return float(res[0]["steps_per_s"])

    g.distributed(2)  # warm: fork server, first optimizer import
    times: dict[str, list[float]] = {"gangrun": [], "torchrun": []}
    for i in range(reps):
        order = [("gangrun", gangrun_), ("torchrun", torchrun)]
        if i % 2:
            order.reverse()
        for name, fn in order:
            times[name].append(fn())
            time.sleep(0.2)
    med = {k: summary(v) for k, v in times.items()}
    return {
        "name": "ddp",
        "unit": "steps/s",
        "omp_num_threads": int(threads),
        "steps": STEPS,
        "results": med,
        "ratios": {
            "gangrun_vs_torchrun": ratio(med["gangrun"]["median"], med["torchrun"]["median"])
        },
    }


if __name__ == "__main__":
    main(run)
