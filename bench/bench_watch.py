"""(9) Watching a run: what progress reporting and the chart grid cost.

- **Warm relaunch in a real kernel** (jupyter_client), 2 ranks, MLflow on in both variants:
  "on" = the live panel (its chart grid, progress line and per-rank rows) and a function
  that calls ``gangrun.report_step`` at every one of its 200 steps and logs a metric;
  "off" = ``progress=False`` (no panel) and the same function without ``report_step``.
  Interleaved, both orders; the fork server preloads mlflow (``GANGRUN_PRELOAD``), so the
  ranks' ``import mlflow`` does not drown the difference.
- **A 10,000-step training loop** (a small MLP: forward, backward, SGD step) inside a real
  rank, with and without ``gangrun.report_step(step, total)`` at every step, in the same
  process, the variants alternating every 500 steps (the ratio is per repetition: 10,000
  steps of each); plus the cost of one ``report_step`` call and its share of a step.
"""

from __future__ import annotations

import os
import tempfile
import time

from _common import both_orders, execute_timed, kernel, main, ratio, report

CELL_SETUP = """\
import time, torch, gangrun
from gangrun import distributed

def work(report: bool, steps: int = 200):
    import mlflow, torch, gangrun
    x = torch.ones(64)
    for step in range(steps):
        x = x * 1.0001
        if report:
            gangrun.report_step(step + 1, steps)
    mlflow.log_metric("value", float(x.sum()), step=steps)
    return float(x.sum())

f_on = distributed(processes=2, timeout=300)(work)
f_off = f_on.options(progress=False)
def timed(g, report):
    t = time.perf_counter(); g.distributed(report); return time.perf_counter() - t
timed(f_on, True); timed(f_off, False)  # warm: fork server, MLflow store, imports
"""
CELL_PAIR = "print('T', timed(f_on, True)); time.sleep(0.2); print('T', timed(f_off, False))"
CELL_PAIR_SWAPPED = (
    "print('T', timed(f_off, False)); time.sleep(0.2); print('T', timed(f_on, True))"
)


def kernel_relaunch(reps: int) -> dict[str, list[float]]:
    with tempfile.TemporaryDirectory() as home:
        env = dict(os.environ, HOME=home, MPLBACKEND="agg")
        env["MLFLOW_TRACKING_URI"] = f"sqlite:///{home}/mlflow.db"
        env["GANGRUN_PRELOAD"] = "torch,mlflow"  # ranks fork with mlflow imported (both variants)
        with kernel(env, home) as kc:
            execute_timed(kc, CELL_SETUP)
            on, off = both_orders(
                2 * reps,
                lambda: tuple(execute_timed(kc, CELL_PAIR)),
                lambda: tuple(execute_timed(kc, CELL_PAIR_SWAPPED)),
            )
    return {"on": on, "off": off}


def training_loop(reps: int, steps: int = 10_000) -> dict:
    """Inside a rank: the same loop with and without a step report at every step."""
    import time as _t

    import torch

    import gangrun

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(16, 32), torch.randn(16, 1)

    block = 500  # the two variants alternate every 500 steps: load drift hits both alike

    def loop(report: bool, start: int) -> float:
        t = _t.perf_counter()
        for step in range(start, start + block):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            if report:
                gangrun.report_step(step + 1, steps)
        return _t.perf_counter() - t

    loop(False, 0)  # warm-up
    out: dict[str, list[float]] = {"with": [], "without": [], "pair_ratio": []}
    for _ in range(reps):  # each rep: 10,000 steps of each variant
        with_s = without_s = 0.0
        for i, start in enumerate(range(0, steps, block)):
            first = bool(i % 2)
            a = loop(first, start)
            b = loop(not first, start)
            with_s += a if first else b
            without_s += b if first else a
        out["with"].append(with_s)
        out["without"].append(without_s)
        out["pair_ratio"].append(with_s / without_s)
    n = 200_000
    t = _t.perf_counter()
    for step in range(n):
        gangrun.report_step(step, n)
    out["per_call_us"] = [(_t.perf_counter() - t) / n * 1e6]
    return out


def panel_costs(reps: int) -> dict[str, list[float]]:
    """What the panel's thread does, timed in this process: per redraw (twice a second) read
    8 ranks' step reports and draw the panel of 8 ranks; per metrics read (every 2.5 s) draw
    the grid of 12 charts of 2 ranks x 1000 steps each."""
    import tempfile as _tf
    import types

    from gangrun.lifecycle.watch import ProgressTracker
    from gangrun.notebook.html import render_panel, svg_chart
    from gangrun.notebook.state import CallState
    from gangrun.rank import progress

    out: dict[str, list[float]] = {"read_ms": [], "render_ms": [], "grid_ms": []}
    with _tf.TemporaryDirectory() as d:
        for r in range(8):
            progress.bind(d, r)
            progress.report_step(1, 1000)
            time.sleep(0.001)
            progress.report_step(100, 1000)
            progress.flush()
        tracker = ProgressTracker(8)
        call = types.SimpleNamespace(fn_name="train", run_id="r", world_size=8, max_restarts=0)
        st = CallState(call)  # the panel reads the call's record: its identity, its world
        st.starting()
        st.attempt_started(0)
        series = {
            f"metric{m:02d}": [(float(s), 1.0 / (s + 1) + r) for s in range(1000) for r in (0, 1)]
            for m in range(12)
        }
        for _ in range(max(5, reps)):
            t = time.perf_counter()
            p = tracker.update(progress.read_all(d, 8), time.time())
            out["read_ms"].append((time.perf_counter() - t) * 1000)
            t = time.perf_counter()
            grid = svg_chart(series)  # once per metrics read (every 2.5 s)
            out["grid_ms"].append((time.perf_counter() - t) * 1000)
            t = time.perf_counter()
            render_panel(st.snapshot, progress=p, grid=grid)  # each redraw (twice a second)
            out["render_ms"].append((time.perf_counter() - t) * 1000)
    return out


def _paired(on: list[float], off: list[float]) -> float:
    import statistics

    return float(statistics.median(a / b for a, b in zip(on, off, strict=True)))


def run(reps: int) -> dict:
    import gangrun

    fn = gangrun.distributed(processes=1, mlflow=False, timeout=1800)(training_loop)
    loop = fn.distributed(max(5, reps))[0]
    kern = kernel_relaunch(reps)
    costs = panel_costs(reps)
    series = {
        "panel_read_8_reports_ms": costs["read_ms"],
        "panel_redraw_8_ranks_ms": costs["render_ms"],
        "chart_grid_12_charts_x_2000_values_ms": costs["grid_ms"],
        "kernel_relaunch_on": kern["on"],
        "kernel_relaunch_off": kern["off"],
        "loop_10k_with_report": loop["with"],
        "loop_10k_without": loop["without"],
        "report_step_us": loop["per_call_us"],
        "loop_10k_ratio_per_rep": loop["pair_ratio"],
    }
    res = report(
        "watch",
        series,
        {"relaunch_progress_grid_on_vs_off": ("kernel_relaunch_on", "kernel_relaunch_off")},
    )
    m = {k: v["median"] for k, v in res["results"].items()}
    res["ratios"].update(
        relaunch_on_vs_off_per_pair=_paired(kern["on"], kern["off"]),
        loop_report_vs_none=m["loop_10k_ratio_per_rep"],
        report_step_share_of_a_step=ratio(
            m["report_step_us"] * 1e-6 * 10_000, m["loop_10k_without"]
        ),
    )
    return res


if __name__ == "__main__":
    main(run, default_reps=5)
