"""(7) Interactive gangs: round trip of a trivial execution on a warm 2-rank gang.

``gangrun.Gang.execute("1")`` on warm ranks, next to a fresh ``.distributed()`` call of a
trivial function (warm fork server) and, when it is installed, ipyparallel's ``%px``
equivalent (``rc[:].execute(..., block=True)``) on 2 engines. Interleaved per repetition.
"""

from __future__ import annotations

import os
import tempfile
import time

from _common import main, ratio, summary, timed


def _trivial() -> int:
    return 1


def _ipyparallel(stack: list) -> object | None:
    try:
        import ipyparallel as ipp
    except ImportError:
        return None
    os.environ["IPYTHONDIR"] = tempfile.mkdtemp(prefix="bench-gang-ipython-")
    cluster = ipp.Cluster(n=2, log_level=40)
    rc = cluster.start_and_connect_sync(activate=False)
    stack.append(cluster)
    rc.wait_for_engines(2, timeout=120)
    view = rc[:]
    return lambda: view.execute("1", block=True)


def run(reps: int) -> dict:
    import gangrun
    from gangrun import distributed

    fresh = distributed(processes=2, mlflow=False, timeout=300)(_trivial)
    fresh.distributed()  # the warm state: a fork server exists
    stack: list = []
    with gangrun.Gang(processes=2, mlflow=False) as g:
        try:
            methods = {"gang_execute": lambda: g.execute("1")}
            px = _ipyparallel(stack)
            if px is not None:
                methods["ipyparallel_px"] = px
            methods["fresh_distributed"] = fresh.distributed
            for fn in methods.values():
                fn()  # warm-up
            times: dict[str, list[float]] = {k: [] for k in methods}
            inner = 20  # executions are short: several per repetition
            for _ in range(reps):
                for name, fn in methods.items():
                    n = 1 if name == "fresh_distributed" else inner
                    for _ in range(n):
                        dt, _ = timed(fn)
                        times[name].append(dt)
                    time.sleep(0.05)
        finally:
            for cluster in stack:
                cluster.stop_cluster_sync()
    res = {k: summary(v) for k, v in times.items()}
    m = {k: v["median"] for k, v in res.items()}
    ratios = {"fresh_call_vs_gang": ratio(m["fresh_distributed"], m["gang_execute"])}
    if "ipyparallel_px" in m:
        ratios["ipyparallel_vs_gang"] = ratio(m["ipyparallel_px"], m["gang_execute"])
    return {
        "name": "gang",
        "unit": "s",
        "goal": {"gang_execute_median_s": 0.010},
        "results": res,
        "ratios": ratios,
        "ipyparallel": "ipyparallel_px" in m,
    }


if __name__ == "__main__":
    main(run)
