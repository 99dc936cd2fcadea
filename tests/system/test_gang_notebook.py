"""examples/interactive.ipynb executes under nbclient: a model loaded once, two learning rates."""

from __future__ import annotations

import pytest
from test_notebook import LINK, mlflow, nbclient, nbformat  # (its import checks too)

from conftest import ROOT, assert_no_survivors

pytestmark = [pytest.mark.slow, pytest.mark.mlflow]  # every test here tracks


def _result(cell) -> str:
    return "".join(
        o["data"].get("text/plain", "")
        for o in cell.outputs
        if o["output_type"] == "execute_result"
    )


def test_interactive_example_notebook(tmp_path):
    nb = nbformat.read(ROOT / "examples" / "interactive.ipynb", as_version=4)
    client = nbclient.NotebookClient(
        nb, kernel_name="python3", timeout=300, resources={"metadata": {"path": str(tmp_path)}}
    )
    with client.setup_kernel():
        kernel_pid = int(client.km.provisioner.process.pid)
        for i, cell in enumerate(nb.cells):
            client.execute_cell(cell, i)
    assert_no_survivors(kernel_pid)
    code = [c for c in nb.cells if c.cell_type == "code"]
    text = "".join(o.get("text", "") for c in code for o in c.outputs)
    assert "[rank 0] model loaded:" in text and "[rank 1] model loaded:" in text
    losses = []
    for cell in code[2:4]:
        lines = _result(cell).splitlines()
        assert [ln.split()[:2] for ln in lines] == [["[rank", "0]"], ["[rank", "1]"]], lines
        vals = {float(ln.split()[-1]) for ln in lines}
        assert len(vals) == 1  # all-reduced: the same on every rank
        losses.append(vals.pop())
    assert losses[0] != losses[1]
    norms = _result(code[4]).splitlines()
    assert len(norms) == 2 and len({ln.split()[-1] for ln in norms}) == 1, norms
    run_id = LINK.search(text).group(1)
    run = mlflow.MlflowClient().get_run(run_id)
    assert run.info.status == "FINISHED"
    assert len(mlflow.MlflowClient().get_metric_history(run_id, "final_loss")) == 2
