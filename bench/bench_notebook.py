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
import queue
import tempfile
import time

from _common import main, ratio, summary

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


def _execute(kc, code: str, timeout: float = 300.0) -> list[float]:
    msg_id = kc.execute(code)
    out: list[float] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            msg = kc.get_iopub_msg(timeout=1)
        except queue.Empty:
            continue
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        c = msg["content"]
        if msg["msg_type"] == "stream":
            out += [float(line.split()[1]) for line in c["text"].splitlines() if line[:2] == "T "]
        elif msg["msg_type"] == "error":
            raise RuntimeError(f"{c['ename']}: {c['evalue']}")
        elif msg["msg_type"] == "status" and c["execution_state"] == "idle":
            return out
    raise TimeoutError(code)


def run(reps: int) -> dict:
    from jupyter_client.manager import KernelManager

    times: dict[str, list[float]] = {"first_call_3s": [], "warm": [], "warm_no_panel": []}
    # (the key keeps its name for the results file; the pause is FIRST_WAIT)
    times["cold"] = []
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as home:
        env.setdefault("MPLBACKEND", "agg")
        env["HOME"] = home
        for _ in range(reps):
            km = KernelManager(kernel_name="python3")
            km.start_kernel(env=env, cwd=home)
            kc = km.blocking_client()
            kc.start_channels()
            try:
                kc.wait_for_ready(timeout=60)
                _execute(kc, CELL_SETUP)
                times["first_call_3s"] += _execute(kc, CELL_FIRST)
                for i in range(4):  # both orders, so neither variant always goes first
                    if i % 2:
                        off, on = _execute(kc, CELL_WARM_SWAPPED)
                    else:
                        on, off = _execute(kc, CELL_WARM)
                    times["warm"].append(on)
                    times["warm_no_panel"].append(off)
                times["cold"] += _execute(kc, CELL_COLD)
            finally:
                kc.stop_channels()
                km.shutdown_kernel(now=False)
    med = {k: summary(v) for k, v in times.items()}
    m = {k: v["median"] for k, v in med.items()}
    return {
        "name": "notebook",
        "unit": "s",
        "results": med,
        "ratios": {
            "first_vs_warm": ratio(m["first_call_3s"], m["warm"]),
            "cold_vs_warm": ratio(m["cold"], m["warm"]),
            "panel_on_vs_off": ratio(m["warm"], m["warm_no_panel"]),
        },
    }


if __name__ == "__main__":
    main(run, default_reps=3)
