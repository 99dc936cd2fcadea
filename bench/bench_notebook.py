"""(7) The notebook: first call a few seconds after decorating, next to a warm relaunch.

A real Jupyter kernel (jupyter_client) is the caller, 2 ranks, a function that imports torch,
``mlflow=False``. Per repetition a fresh kernel imports torch (as a notebook does),
decorates the function (which starts the fork server, and imports the modules a call needs,
in the background), waits 3 s (``BENCH_FIRST_WAIT_S``) and calls it ("first call"); then relaunches it warm with the live panel on and off, interleaved. The
"cold" figure is a call made right after discarding the fork server (what a first call cost
before the background start).
"""

from __future__ import annotations

import os
import tempfile

from _common import both_orders, execute_timed, kernel, main, report

CELL_SETUP = """\
import time, torch, workloads
from gangrun import distributed
from gangrun.launch import forkserver
f = distributed(processes=2, mlflow=False, timeout=300)(workloads.relaunch_fn)
f_off = f.options(progress=False)
def timed(g):
    t = time.perf_counter(); g.distributed(); return time.perf_counter() - t
"""
# The pause between decorating and the first call; on a loaded machine the background
# prewarm (a fresh interpreter importing torch) can take longer than 3 s: BENCH_FIRST_WAIT_S.
FIRST_WAIT = float(os.environ.get("BENCH_FIRST_WAIT_S", "3"))
CELL_FIRST = f"time.sleep({FIRST_WAIT}); print('T', timed(f))"
CELL_WARM = "print('T', timed(f)); time.sleep(0.2); print('T', timed(f_off)); time.sleep(0.2)"
CELL_WARM_SWAPPED = (
    "print('T', timed(f_off)); time.sleep(0.2); print('T', timed(f)); time.sleep(0.2)"
)
CELL_COLD = "forkserver.discard_server(); print('T', timed(f_off))"


def run(reps: int) -> dict:
    times: dict[str, list[float]] = {"first_call_3s": [], "warm": [], "warm_no_panel": []}
    # (the key keeps its name for the results file; the pause is FIRST_WAIT)
    times["cold"] = []
    with tempfile.TemporaryDirectory() as home:
        env = dict(os.environ, HOME=home)
        env.setdefault("MPLBACKEND", "agg")
        for _ in range(reps):
            with kernel(env, home) as kc:
                execute_timed(kc, CELL_SETUP)
                times["first_call_3s"] += execute_timed(kc, CELL_FIRST)
                on, off = both_orders(  # 4 pairs, both orders
                    4,
                    lambda kc=kc: tuple(execute_timed(kc, CELL_WARM)),
                    lambda kc=kc: tuple(execute_timed(kc, CELL_WARM_SWAPPED)),
                )
                times["warm"] += on
                times["warm_no_panel"] += off
                times["cold"] += execute_timed(kc, CELL_COLD)
    return report(
        "notebook",
        times,
        {
            "first_vs_warm": ("first_call_3s", "warm"),
            "cold_vs_warm": ("cold", "warm"),
            "panel_on_vs_off": ("warm", "warm_no_panel"),
        },
    )


if __name__ == "__main__":
    main(run, default_reps=3)
