"""A resume (``run_id=``) that gangrun refuses changes nothing of the MLflow run.

One real call saves checkpoints, logs its loss and fails (the run ends FAILED with its
error). Then each refusal of a resume of that run, all before any rank starts: a live call
holding the run, a live writer holding its checkpoint location, a ``checkpoint_dir=`` that
cannot be written, every recorded checkpoint damaged, the checkpoints deleted. After each,
every tag (the original error first), param, metric (its whole history) and the status and
end time of the run are what they were: the refusal comes before the run is touched, as the
live-lease refusal always did."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import mlflow
import pytest
import writer_funcs

import gangrun
from conftest import assert_no_survivors
from gangrun import LaunchError, checkpoint
from gangrun.checkpoint import writer
from gangrun.host.system import process_identity
from gangrun.wire.records import pid_namespace
from gangrun.wire.tags import TAG_ERROR, TAG_LEASE

pytestmark = [pytest.mark.slow, pytest.mark.mlflow]


def _snapshot(client, run_id):
    run = client.get_run(run_id)
    history = {
        key: sorted((m.step, m.value, m.timestamp) for m in client.get_metric_history(run_id, key))
        for key in run.data.metrics
    }
    return {
        "status": run.info.status,
        "end_time": run.info.end_time,
        "tags": dict(run.data.tags),
        "params": dict(run.data.params),
        "metrics": dict(run.data.metrics),
        "history": history,
    }


def _refused(fn, run_id, **opts):
    with pytest.raises(LaunchError) as info:
        fn.options(run_id=run_id, **opts).distributed(3)
    return str(info.value)


def test_a_refused_resume_leaves_the_run_as_it_was(tmp_path):
    where = str(tmp_path / "ckpt")
    fn = gangrun.distributed(processes=1, timeout=120, output="none")(writer_funcs.saves_then_fails)
    first = fn.options(checkpoint_dir=where).submit(3)
    with pytest.raises(gangrun.DistributedError, match="the first failure, after 3 steps"):
        first.result(timeout=120)
    run_id = first.mlflow_run_id
    assert run_id
    client = mlflow.MlflowClient()
    before = _snapshot(client, run_id)
    assert before["status"] == "FAILED" and "the first failure" in before["tags"][TAG_ERROR]
    assert before["history"]["loss"] and before["params"], before
    kept = checkpoint.list_checkpoints(where)
    assert len(kept) == 2, kept

    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        ident = {
            "host": socket.gethostname(),
            "pid_ns": pid_namespace(),
            "pid": other.pid,
            "caller": process_identity(other.pid),
        }
        # a live call holds the run (its lease, the run RUNNING): the refusal it always had
        client.set_tag(run_id, TAG_LEASE, json.dumps({**ident, "call": "c0ffee"}))
        client.update_run(run_id, status="RUNNING")
        held = _snapshot(client, run_id)
        msg = _refused(fn, run_id)
        assert "that MLflow run is in use by a running call" in msg, msg
        assert _snapshot(client, run_id) == held
        client.delete_tag(run_id, TAG_LEASE)
        client.set_terminated(run_id, "FAILED", end_time=before["end_time"])
        assert _snapshot(client, run_id) == before

        # a live writer holds the run's checkpoint location
        lock = writer.lock_path(where)
        with open(lock, "w") as f:
            json.dump({**ident, "call": "c0ffee", "function": "other", "time": 0}, f)
        msg = _refused(fn, run_id)
        assert f"checkpoint_dir={where!r} is in use by a running call: other" in msg, msg
        assert _snapshot(client, run_id) == before
        os.remove(lock)
    finally:
        other.kill()
        other.wait(10)

    # a checkpoint_dir= that cannot be written (a file stands where its directory would be)
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    msg = _refused(fn, run_id, checkpoint_dir=str(blocked / "ckpt"))
    assert "cannot be written" in msg, msg
    assert _snapshot(client, run_id) == before

    # every recorded checkpoint damaged
    for url in kept:
        for name in os.listdir(url):
            if name.endswith(".distcp"):
                with open(os.path.join(url, name), "r+b") as f:
                    f.truncate(1)
    msg = _refused(fn, run_id)
    assert f"MLflow run {run_id} cannot resume: no valid checkpoint in {where}" in msg, msg
    assert _snapshot(client, run_id) == before

    # the recorded checkpoints deleted
    for url in kept:
        checkpoint.remove(url)
    msg = _refused(fn, run_id)
    assert "no complete checkpoint is there now" in msg, msg
    after = _snapshot(client, run_id)
    assert after == before, {k: (before[k], after[k]) for k in before if before[k] != after[k]}
    assert not os.path.exists(writer.lock_path(where))  # no refusal left the location taken
    assert_no_survivors()
