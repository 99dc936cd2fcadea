"""The live panel proven in a real browser: the quickstart notebook executed, rendered by
nbconvert and loaded by headless Chromium, whose DOM must hold the panel's rows and chart."""

from __future__ import annotations

import re

import pytest

from conftest import ROOT

pytest.importorskip("nbconvert")
pytest.importorskip("nbclient")
mlflow = pytest.importorskip("mlflow")

from notebook_render import browse, execute_and_render  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.mlflow]  # every test here tracks


def test_quickstart_panel_renders_in_chromium(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    monkeypatch.setenv("HOME", str(tmp_path))
    html, nb = execute_and_render(ROOT / "examples" / "quickstart.ipynb", tmp_path)
    # the saved notebook holds the frozen final panel
    panels = [
        o["data"]["text/html"]
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.outputs
        if "gangrun-panel" in o.get("data", {}).get("text/html", "")
    ]
    assert panels and 'data-final="FINISHED"' in panels[-1]
    dom = browse(html, "--dump-dom", "--virtual-time-budget=3000")
    assert 'class="gangrun-panel"' in dom and 'data-final="FINISHED"' in dom
    # attribute order is the DOM serializer's, not the panel's: read each row's attributes
    rows = [
        dict(re.findall(r'([\w-]+)="([^"]*)"', t))
        for t in re.findall(r'<tr class="gangrun-rank"[^>]*>', dom)
    ]
    assert sorted((r["data-rank"], r["data-state"]) for r in rows) == [
        ("0", "finished"),
        ("1", "finished"),
    ], rows
    # each rank's memory: resident bytes against its limit, shown in the row
    assert all(0 < int(r["data-rss"]) < int(r["data-limit"]) for r in rows), rows
    assert re.search(r'<svg class="gangrun-chart"[^>]*>.*<polyline', dom, re.S)
    # the chart grid: one chart per metric, each on its own axes; both ranks' "loss" at each
    # step is one mean line with a min-max band; "total_loss" (once per epoch) has markers
    tags = re.findall(r'<div class="gangrun-metric"[^>]*>', dom)  # attribute order may change
    charts = {re.search(r'data-metric="(\w+)"', t).group(1): t for t in tags}
    assert {"loss", "total_loss"} <= set(charts), charts
    assert 'data-band="1"' in charts["loss"] and 'data-points="5"' in charts["total_loss"]
    ymax = {k: float(re.search(r'data-y-max="([^"]+)"', v).group(1)) for k, v in charts.items()}
    assert ymax["total_loss"] > 50 * ymax["loss"]  # own y ranges, not one shared axis
    assert "gangrun.step" not in charts  # gangrun's own final values are not charted
    assert re.search(r'class="gangrun-progress">step 80/80', dom)  # gangrun.report_step
    shot = tmp_path / "page.png"
    browse(html, f"--screenshot={shot}", "--window-size=1000,1400")
    assert shot.stat().st_size > 10_000
