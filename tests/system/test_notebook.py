"""The notebook experience, in a real IPython kernel driven by nbclient.

The kernel is the caller: it inherits this process's environment (``PYTHONPATH`` to ``src``,
the MLflow store of the test), so its ranks carry ``GANGRUN_CALLER_PID=<kernel pid>``.
"""

from __future__ import annotations

import re
import threading
import time

import pytest

from conftest import ROOT, assert_no_survivors, run_processes

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
mlflow = pytest.importorskip("mlflow")
pytest.importorskip("ipykernel")

pytestmark = [pytest.mark.slow, pytest.mark.mlflow]  # every test here tracks

LINK = re.compile(r"gangrun: MLflow run ([0-9a-f]{32})")


@pytest.fixture(scope="module")
def _store_uri(tmp_path_factory):
    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow-nb')}/mlflow.db"
    mlflow.MlflowClient(tracking_uri=uri).search_experiments()  # create the schema once
    return uri


@pytest.fixture
def store(_store_uri, tmp_path, monkeypatch, request):
    client = mlflow.MlflowClient(tracking_uri=_store_uri)
    exp = client.create_experiment(
        f"{request.node.name}-{time.time_ns()}", artifact_location=str(tmp_path / "artifacts")
    )
    monkeypatch.setenv("MLFLOW_TRACKING_URI", _store_uri)  # the kernel inherits these
    monkeypatch.setenv("MLFLOW_EXPERIMENT_ID", exp)
    client.experiment_id = exp
    return client


def _client(nb, tmp_path, **kw):
    return nbclient.NotebookClient(
        nb,
        kernel_name="python3",
        timeout=180,
        resources={"metadata": {"path": str(tmp_path)}},
        **kw,
    )


def _text(cell, name=None) -> str:
    return "".join(
        o.get("text", "")
        for o in cell.outputs
        if o.get("output_type") == "stream" and (name is None or o.get("name") == name)
    )


def _render(text: str) -> list[str]:
    """What a terminal/Jupyter shows: each line as left by its last carriage return."""
    return [line.rsplit("\r", 1)[-1] for line in text.split("\n")]


def _kernel_pid(client) -> int:
    return int(client.km.provisioner.process.pid)


CELL_IMPORTS = """\
import torch
from torch import nn
from gangrun import distributed
"""

CELL_MODEL = """\
class MLP(nn.Module):
    def __init__(self, d_in=8, hidden=32):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, x):
        return self.net(x)


def make_data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return x, x.sum(dim=1, keepdim=True)
"""

CELL_TRAIN = """\
@distributed(processes=2, timeout=120)
def train(epochs: int = 3, steps: int = 25, lr: float = 0.05) -> float:
    import mlflow
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from tqdm import tqdm

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(MLP())
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    x, y = make_data(512, seed=rank)
    bar = tqdm(total=epochs * steps, desc="train", disable=rank != 0, mininterval=0, ascii=True)
    for epoch in range(epochs):
        for step in range(steps):
            i = (step * 16) % 512
            loss = nn.functional.mse_loss(model(x[i : i + 16]), y[i : i + 16])
            opt.zero_grad()
            loss.backward()
            opt.step()
            bar.update(1)
        mlflow.log_metric(f"rank{rank}/loss", loss.item(), step=epoch)
        print(f"epoch {epoch} loss {loss.item():.4f}")
    bar.close()
    dist.destroy_process_group()
    return loss.item()
"""

CELL_LAUNCH = """\
losses = train.distributed(epochs=3)
print("losses", losses)
"""


def test_notebook_ddp_training_output_and_mlflow(store, tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(CELL_IMPORTS),
        nbformat.v4.new_code_cell(CELL_MODEL),
        nbformat.v4.new_code_cell(CELL_TRAIN),
        nbformat.v4.new_code_cell(CELL_LAUNCH),
        nbformat.v4.new_code_cell("print('after')"),
    ]
    t0 = time.monotonic()
    client = _client(nb, tmp_path)
    with client.setup_kernel():
        kernel_pid = _kernel_pid(client)
        for i, cell in enumerate(nb.cells):
            client.execute_cell(cell, i)
        assert_no_survivors(kernel_pid)
    elapsed = time.monotonic() - t0

    launch = nb.cells[3]
    out, err = _text(launch, "stdout"), _text(launch, "stderr")
    for rank in (0, 1):
        for epoch in range(3):
            assert f"[rank {rank}] epoch {epoch} loss " in out, out
    assert "losses [" in out
    m = LINK.search(out)
    assert m, out
    assert "mlflow ui --backend-store-uri" in out

    # the tqdm bar of rank 0: many live redraws, but one line on screen
    bar_lines = [ln for ln in _render(err) if "train:" in ln]
    assert len(bar_lines) == 1, err
    assert bar_lines[0].startswith("[rank 0] train: 100%"), bar_lines
    assert err.count("\r") >= 3, err  # redrawn live (reads may coalesce updates)
    assert not any("train:" in ln for ln in _render(err + out) if ln.startswith("[rank 1]"))
    assert "IProgress" not in err  # no noise from importing mlflow in the kernel
    # nothing of the ranks leaked into the next cell
    assert _text(nb.cells[4]) == "after\n"

    run = store.get_run(m.group(1))
    assert run.info.status == "FINISHED"
    assert run.info.experiment_id == store.experiment_id
    for rank in (0, 1):
        hist = store.get_metric_history(run.info.run_id, f"rank{rank}/loss")
        assert sorted(h.step for h in hist) == [0, 1, 2]
    assert run.data.params["epochs"] == "3"
    print(f"notebook DDP test: {elapsed:.1f}s including kernel start")


CELL_LONG = """\
@distributed(processes=2, timeout=300)
def long_job(seconds: float) -> int:
    import os
    import time

    import mlflow
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mlflow.log_metric(f"rank{rank}/up", 1)
    print("started", flush=True)
    t = torch.ones(1)
    for _ in range(int(seconds / 0.05)):  # the same number of collectives on every rank
        dist.all_reduce(t)
        time.sleep(0.05)
    dist.destroy_process_group()
    return rank
"""


def test_interrupt_kernel_stops_every_rank_and_rerun_works(store, tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("from gangrun import distributed"),
        nbformat.v4.new_code_cell(CELL_LONG),
        nbformat.v4.new_code_cell("SECONDS = 120"),
        nbformat.v4.new_code_cell("result = long_job.distributed(SECONDS)\nprint(result)"),
        nbformat.v4.new_code_cell("SECONDS = 0.5"),
    ]
    client = _client(nb, tmp_path, allow_errors=True)
    with client.setup_kernel():
        kernel_pid = _kernel_pid(client)
        for i in range(3):
            client.execute_cell(nb.cells[i], i)

        timing: dict[str, float] = {}

        def interrupter() -> None:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # both ranks up and logging
                if len(run_processes(kernel_pid)) >= 2 and _started(store):
                    break
                time.sleep(0.1)
            time.sleep(0.5)
            timing["interrupt"] = time.monotonic()
            from jupyter_core.utils import run_sync

            run_sync(client.km.interrupt_kernel)()

        th = threading.Thread(target=interrupter, daemon=True)
        th.start()
        launch = nb.cells[3]
        client.execute_cell(launch, 3)
        cell_done = time.monotonic()
        th.join(10)
        assert "interrupt" in timing, "the run never started"
        assert_no_survivors(kernel_pid, wait=0.5)
        stop_s = cell_done - timing["interrupt"]

        errors = [o for o in launch.outputs if o.get("output_type") == "error"]
        assert errors and errors[0]["ename"] == "KeyboardInterrupt", launch.outputs
        out = _text(launch, "stdout")
        assert "[rank 0] started" in out and "[rank 1] started" in out, out
        m = LINK.search(out)
        assert m, out
        run = store.get_run(m.group(1))
        assert run.info.status == "KILLED"
        assert "interrupted" in run.data.tags["gangrun.status_reason"]

        # run the same cell again, right away: it works (no port or file left busy)
        client.execute_cell(nb.cells[4], 4)
        assert _text(nb.cells[4]) == ""  # nothing of the stopped ranks leaked in here
        t0 = time.monotonic()
        client.execute_cell(launch, 3)
        rerun_s = time.monotonic() - t0
        assert not [o for o in launch.outputs if o.get("output_type") == "error"], launch.outputs
        out2 = _text(launch, "stdout")
        assert "[0, 1]" in out2, out2
        m2 = LINK.search(out2)
        assert m2 and m2.group(1) != m.group(1)
        assert store.get_run(m2.group(1)).info.status == "FINISHED"
        assert_no_survivors(kernel_pid)
    assert stop_s < 10, f"interrupt took {stop_s:.1f}s to stop the ranks"
    print(f"interrupt -> cell done: {stop_s:.2f}s; rerun: {rerun_s:.1f}s")


def _started(store) -> bool:
    """Both ranks have logged their 'up' metric to the newest run of the experiment."""
    runs = store.search_runs([store.experiment_id], max_results=1, order_by=["start_time DESC"])
    return bool(runs) and {"rank0/up", "rank1/up"} <= set(runs[0].data.metrics)


def test_quickstart_example_notebook_runs(store, tmp_path):
    path = ROOT / "examples" / "quickstart.ipynb"
    nb = nbformat.read(str(path), as_version=4)
    client = _client(nb, tmp_path)
    with client.setup_kernel():
        kernel_pid = _kernel_pid(client)
        for i, cell in enumerate(nb.cells):
            if cell.cell_type == "code":
                client.execute_cell(cell, i)
        assert_no_survivors(kernel_pid)
    text = "\n".join(_text(c) for c in nb.cells if c.cell_type == "code")
    assert "[rank 0]" in text and "[rank 1]" in text
    m = LINK.search(text)
    assert m, text
    run = store.get_run(m.group(1))
    assert run.info.status == "FINISHED"
    assert {"loss", "total_loss", "gangrun.step"} <= set(run.data.metrics)
