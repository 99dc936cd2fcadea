"""Each rank's memory while a call runs: its own memory sample in the run directory, and the
run's MLflow system metrics per rank (``system/rank_<r>_memory_rss_megabytes``...), so the
rank nearest its limit is visible while it runs and afterwards."""

from __future__ import annotations

import pytest
from watchfns import holds_memory

import gangrun
from conftest import assert_no_survivors


@pytest.mark.mlflow
def test_each_ranks_memory_is_among_the_runs_system_metrics(monkeypatch):
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.5")
    fn = gangrun.distributed(processes=2, log_system_metrics=True, timeout=120)(holds_memory)
    handle = fn.submit(200, 4.0)
    assert handle.result(timeout=120) == [0, 200 << 20]
    client = MlflowClient()
    run_id = handle.mlflow_run_id
    assert run_id
    peak = {}
    for r in (0, 1):
        hist = client.get_metric_history(run_id, f"system/rank_{r}_memory_rss_megabytes")
        assert hist, f"rank {r}: no memory metric in {sorted(client.get_run(run_id).data.metrics)}"
        peak[r] = max(m.value for m in hist)
        share = client.get_metric_history(run_id, f"system/rank_{r}_memory_limit_percentage")
        assert share and 0 < max(m.value for m in share) < 100
    assert peak[1] - peak[0] > 150, peak  # rank 1 holds 200 MiB (210 MB) more
    names = client.get_run(run_id).data.metrics
    assert not [n for n in names if "cuda" in n], names  # no GPU here: no CUDA figures
    assert_no_survivors()
