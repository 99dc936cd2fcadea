"""(9) Ray clusters: environment synchronisation and cluster gangs.

On a real two-raylet cluster on loopback (the second raylet in its own mount namespace, the
project directory hidden there: ``tests/system/raycluster.py``; needs root and ``unshare``):

- the start of a 2-rank ``backend="ray"`` call of a trivial function from a 50 MB project:
  the first call (hash, zip, upload, download on the node) against the second, unchanged
  one (one ``stat`` per file and one GCS lookup), and the same call with shipping off;
- ``g.execute("1")`` on a warm 2-rank gang with one rank on each raylet, against the same
  gang on one node (``backend="local"``) and a plain Ray actor method call
  (``ray.get(actor.f.remote())``) on the second raylet.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time

from _common import ROOT, main, ratio, summary, timed

sys.path.insert(0, os.path.join(ROOT, "tests", "system"))
MB = 1 << 20


def _trivial() -> int:
    return 1


def _project(root: str, mb: int = 50) -> str:
    proj = os.path.join(root, "project")
    os.makedirs(os.path.join(proj, "data"))
    for i in range(mb // 5):
        with open(os.path.join(proj, "data", f"shard{i}.bin"), "wb") as f:
            f.write(os.urandom(5 * MB))
    with open(os.path.join(proj, "train.py"), "w") as f:
        f.write("VALUE = 1\n")
    return proj


def _count_uploads() -> list[str]:
    """The packages gangrun sends to the cluster from now on (what `ship.upload` logs)."""
    import logging

    sent: list[str] = []

    class Sent(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if str(record.msg).startswith("shipped ") and isinstance(record.args, tuple):
                sent.append(str(record.args[1]))

    shiplog = logging.getLogger("gangrun.launch.ray")
    shiplog.addHandler(Sent())
    shiplog.setLevel(logging.INFO)
    return sent


def run(reps: int) -> dict:
    import ray
    from raycluster import TwoRaylets

    import gangrun

    hidden = tempfile.mkdtemp(prefix="bench-ray-hidden-")
    temp = tempfile.mkdtemp(prefix="bray-", dir="/tmp")
    cluster = TwoRaylets(temp, hidden).start()
    old = os.getcwd()
    try:
        os.chdir(_project(hidden))
        ray.init(address=cluster.address, log_to_driver=False, logging_level="WARNING")
        opts = dict(
            processes=2,
            backend="ray",
            address=cluster.address,
            mlflow=False,
            env={"GANGRUN_RAY_STRATEGY": "STRICT_SPREAD"},
        )
        fn = gangrun.distributed(**opts)(_trivial)
        no_ship = gangrun.distributed(**opts, ray={"ship": False})(_trivial)
        sent = _count_uploads()
        first, _ = timed(fn.distributed)
        uploads = len(sent)
        times: dict[str, list[float]] = {"call_first_50mb": [first], "call_unchanged_50mb": []}
        times["call_no_ship"] = []
        for _ in range(reps):
            times["call_unchanged_50mb"].append(timed(fn.distributed)[0])
            times["call_no_ship"].append(timed(no_ship.distributed)[0])
        reuploaded = len(sent) - uploads

        @ray.remote(num_cpus=0, resources={"other_node": 0.01})
        class Echo:
            def f(self) -> int:
                return 1

        actor = Echo.remote()
        ray.get(actor.f.remote())
        gangs = {
            "gang_execute_two_raylets": gangrun.Gang(**opts),
            "gang_execute_one_node": gangrun.Gang(processes=2, mlflow=False),
        }
        methods = {k: (lambda g=g: g.execute("1")) for k, g in gangs.items()}
        methods["ray_actor_call"] = lambda: ray.get(actor.f.remote())
        try:
            for m in methods.values():
                m()
            for k in methods:
                times[k] = []
            for _ in range(reps):
                for name, m in methods.items():
                    for _ in range(40):
                        times[name].append(timed(m)[0])
                    time.sleep(0.05)
        finally:
            for g in gangs.values():
                g.close()
            ray.kill(actor)
    finally:
        os.chdir(old)
        ray.shutdown()
        left = cluster.stop()
        shutil.rmtree(hidden, ignore_errors=True)
        shutil.rmtree(temp, ignore_errors=True)
    res = {k: summary(v) for k, v in times.items()}
    m = {k: v["median"] for k, v in res.items()}
    return {
        "name": "ray",
        "unit": "s",
        "goal": {"gang_execute_two_raylets_median_s": 0.005},
        "results": res,
        "ratios": {
            "first_vs_unchanged_call": ratio(m["call_first_50mb"], m["call_unchanged_50mb"]),
            "unchanged_vs_no_ship_call": ratio(m["call_unchanged_50mb"], m["call_no_ship"]),
            "two_raylets_vs_one_node_gang": ratio(
                m["gang_execute_two_raylets"], m["gang_execute_one_node"]
            ),
            "two_raylets_gang_vs_ray_actor_call": ratio(
                m["gang_execute_two_raylets"], m["ray_actor_call"]
            ),
        },
        "reuploads_of_unchanged_project": reuploaded,
        "cluster_processes_left": left,
    }


if __name__ == "__main__":
    main(run, default_reps=3)
