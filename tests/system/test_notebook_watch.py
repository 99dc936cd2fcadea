"""Watching a run in real Jupyter kernels: the chart grid (own axes per metric, one mean line with
a min-max band for the ranks' values), progress/ETA, a slow and a silent rank in the panel,
and ``gangrun ps / stacks / stop`` from another process while the kernel is busy."""

from __future__ import annotations

import re
import shutil
import tempfile

import pytest

pytest.importorskip("jupyter_client")
pytest.importorskip("ipykernel")
mlflow = pytest.importorskip("mlflow")

from kernelharness import Kernel, open_kernel  # noqa: E402
from test_watch import cli, wait_listed  # noqa: E402

from gangrun.wire.contract import SILENT_AFTER, SLOW_AFTER  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.mlflow]  # every test here tracks


@pytest.fixture
def kernel(tmp_path):
    store = tempfile.mkdtemp(prefix="gr-")  # a short path, as a user's would be
    setup = "import time, gangrun\nfrom gangrun import distributed"
    slow = {SLOW_AFTER: "1", SILENT_AFTER: "1.5"}  # the one-minute windows, shortened
    try:
        with open_kernel(tmp_path, store, setup, **slow) as k:
            yield k
    finally:
        shutil.rmtree(store, ignore_errors=True)


def _panels(k: Kernel, msg_id: str) -> list[str]:
    return [
        m["content"]["data"]["text/html"]
        for m in k.of(msg_id, "display_data", "update_display_data")
        if "gangrun-panel" in m["content"]["data"].get("text/html", "")
    ]


GRID = """\
@distributed(processes=2, timeout=120)
def grid(steps: int = 40, per_epoch: int = 10):
    import os, time, mlflow, gangrun
    rank = int(os.environ["RANK"])
    for step in range(steps):
        mlflow.log_metric("loss", 1.0 / (step + 1) + 0.05 * rank, step=step)  # ~1, both ranks
        if rank == 0 and step % per_epoch == per_epoch - 1:  # ~1000, once per epoch
            mlflow.log_metric("epoch_total", 1000.0 + 10 * step, step=step // per_epoch)
        gangrun.report_step(step + 1, steps)
        time.sleep(0.1 if rank == 1 else 0.01)  # rank 1 is slow
    if rank == 1:
        time.sleep(3)  # and then silent
    return rank
print(grid.distributed())
"""


def _chart(html: str, name: str) -> str:
    m = re.search(rf'<div class="gangrun-metric" data-metric="{name}".*?</svg></div>', html)
    assert m, (name, html[-3000:])
    return m.group(0)


def test_chart_grid_progress_slow_and_silent_ranks_in_the_panel(kernel):
    msg = kernel.execute(GRID, timeout=180)
    assert kernel.error(msg) is None, kernel.error(msg)
    text = kernel.stream(msg)
    assert "[0, 1]" in text
    # quiet: MLflow's INFO lines on the first use of this (new) store stay out of the cell,
    # and the hint to view the run fits 100 columns on at most two lines
    assert "INFO mlflow" not in text and "Creating initial MLflow database" not in text, text
    hint = [line for line in text.splitlines() if "MLflow run" in line or "mlflow ui" in line]
    assert 1 <= len(hint) <= 2 and all(len(line) <= 100 for line in hint), hint
    panels = _panels(kernel, msg)
    final = panels[-1]
    assert 'data-final="FINISHED"' in final
    loss, total = _chart(final, "loss"), _chart(final, "epoch_total")
    # own axes: the per-step loss (~1) and the per-epoch total (~1000) each fill their chart
    assert 'data-points="40"' in loss and 'data-step-max="39"' in loss
    assert 'data-points="4"' in total and 'data-step-max="3"' in total
    lo_max = float(re.search(r'data-y-max="([^"]+)"', loss).group(1))
    tot_min = float(re.search(r'data-y-min="([^"]+)"', total).group(1))
    assert lo_max < 2 and tot_min > 900
    # two ranks, one key: one mean line and a min-max band; rank 0 alone: no band
    assert loss.count("<polyline") == 1 and 'data-band="1"' in loss and "<polygon" in loss
    assert total.count("<polyline") == 1 and 'data-band="0"' in total
    assert total.count("<circle") == 4  # few points: a marker on each epoch
    assert "1390 @ 3" in total  # the latest value and its step
    assert 'class="gangrun-progress">step 40/40 (100%)' in final
    live = panels[:-1]
    assert any("gangrun-metric" in p for p in live)  # updated in place while running
    assert any(re.search(r"gangrun-progress\">step \d+/40 \(\d+%\) · .* · ETA", p) for p in live)
    slow = [p for p in live if re.search(r'data-rank="1" data-state="running" data-slow="0\.', p)]
    assert slow and "slow 0." in slow[-1]
    assert not any(re.search(r'data-rank="0"[^>]*data-slow', p) for p in live)
    silent = [p for p in live if re.search(r'data-rank="1"[^>]*data-silent="\d+"', p)]
    assert silent and "handle.stacks()" in silent[-1]
    assert "data-silent" not in final  # frozen: no live marks in the saved notebook
    # each rank's memory in its row: resident memory of its tree against its limit
    for r in (0, 1):
        row = re.compile(rf'data-rank="{r}"[^>]*data-rss="(\d+)" data-limit="(\d+)"')
        assert any(row.search(p) for p in live), r
    assert re.search(r"<td [^>]*>[\d.]+ [MG]iB of [\d.]+ [MG]iB \(\d+%\)</td>", live[-1])


BUSY = """\
@distributed(processes=2, timeout=300)
def forever():
    import time, gangrun
    def train_loop():
        step = 0
        while True:
            step += 1
            gangrun.report_step(step)
            time.sleep(0.02)
    train_loop()
h = forever.submit()
t0 = time.time()
while not h.done() and time.time() - t0 < 120:
    sum(range(1000))  # the kernel's main thread is busy in Python the whole time
try:
    h.result()
except gangrun.DistributedError as e:
    print("CAUGHT", type(e).__name__, e)
"""


def test_ps_stacks_stop_against_a_busy_kernel(kernel):
    msg = kernel.execute(BUSY, wait=False)
    rec = wait_listed(kernel.pid, timeout=90)
    rid, mlflow_id = rec["run_id"], rec["mlflow_run_id"]
    assert rec["caller_kind"] == "kernel" and rec["function"] == "forever"
    assert re.search(
        rf"^{rid}\s+forever\s+2\s.*running\s+{mlflow_id}\s+{kernel.pid} kernel$",
        cli("ps").stdout,
        re.M,
    )
    st = cli("stacks", rid)
    assert st.returncode == 0 and st.stdout.count("in train_loop") == 2, st.stdout + st.stderr
    logs = cli("logs", rid[:5])
    assert logs.returncode == 0, logs.stderr  # nothing printed yet: an empty log is fine
    stop = cli("stop", mlflow_id)  # by the MLflow run id
    assert stop.returncode == 0 and "KILLED" in stop.stdout, stop.stdout + stop.stderr
    kernel.wait_idle(msg, timeout=60)
    out = kernel.stream(msg)
    assert "CAUGHT DistributedCancelledError" in out, out
    assert "stopped from the command line (gangrun stop, pid" in out
    client = mlflow.MlflowClient(tracking_uri=kernel.tracking_uri)
    assert client.get_run(mlflow_id).info.status == "KILLED"
    again = kernel.execute("print('still usable', 1 + 1)")
    assert "still usable 2" in kernel.stream(again)
    assert not [
        r for r in __import__("json").loads(cli("ps", "--json").stdout) if r["run_id"] == rid
    ]
