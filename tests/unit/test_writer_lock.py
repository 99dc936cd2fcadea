"""One writer per checkpoint location: the lock file a call takes in its
location (`gangrun.checkpoint.writer`), and the rank's one-manager-per-location registry
(`gangrun.rank.location`). Real files, real (dead) processes; the calls themselves are in
tests/reliability/test_one_writer.py."""

from __future__ import annotations

import gc
import json
import os
import socket
import subprocess
import threading
import uuid

import pytest

from gangrun import LaunchError
from gangrun.checkpoint import writer
from gangrun.host.system import process_identity
from gangrun.rank import location


def _lock_file(where) -> dict:
    with open(os.path.join(where, writer.LOCK_NAME)) as f:
        return json.load(f)


def test_taken_named_refused_and_given_back(tmp_path):
    where = str(tmp_path)
    held = writer.acquire(where, "call-a", "train", "mlrun1")
    rec = _lock_file(where)
    assert rec["call"] == "call-a" and rec["pid"] == os.getpid() and rec["function"] == "train"
    assert rec["caller"] == process_identity(os.getpid()) and rec["mlflow_run_id"] == "mlrun1"
    assert [n for n in os.listdir(where)] == [writer.LOCK_NAME]  # no temporary file left
    with pytest.raises(LaunchError) as info:
        writer.acquire(where + "/", "call-b", "train")
    msg = str(info.value)
    assert "is in use by a running call: train (gangrun call call-a, MLflow run mlrun1)" in msg
    assert f"on host {socket.gethostname()}, pid {os.getpid()} (this process)" in msg
    assert "gangrun stop call-a" in msg
    assert writer.holder(where)["live"] is True
    held.release()
    held.release()  # idempotent
    assert os.listdir(where) == [] and writer.holder(where) is None
    writer.acquire(where, "call-b", "train").release()


def test_a_dead_callers_lock_is_taken_over(tmp_path):
    proc = subprocess.Popen(["sleep", "30"])
    ident = process_identity(proc.pid)
    proc.kill()
    proc.wait(10)
    rec = dict(writer.record("dead-call", "train", None), pid=proc.pid, caller=ident)
    (tmp_path / writer.LOCK_NAME).write_text(json.dumps(rec))
    assert writer.holder(str(tmp_path))["live"] is False
    held = writer.acquire(str(tmp_path), "call-c", "train")
    assert _lock_file(tmp_path)["call"] == "call-c"
    held.release()


@pytest.mark.parametrize("stale", [False, True])
def test_many_takers_at_once_one_wins(tmp_path, stale):
    """Threads of this process (each a call) take one location at the same instant, free or
    held by a call that ended: exactly one gets it, every other is told who has it."""
    if stale:
        rec = writer.record("ended-call", "train", None)
        (tmp_path / writer.LOCK_NAME).write_text(json.dumps(rec))
    start = threading.Barrier(8)
    got, refused = [], []

    def take(i: int) -> None:
        start.wait()
        try:
            got.append(writer.acquire(str(tmp_path), f"call-{i}", "train"))
        except LaunchError as exc:
            refused.append(str(exc))

    threads = [threading.Thread(target=take, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(got) == 1 and len(refused) == 7, refused
    assert all(f"gangrun call {got[0].call_id}" in msg for msg in refused), refused
    assert _lock_file(tmp_path)["call"] == got[0].call_id
    got[0].release()


def test_a_call_of_this_process_that_ended_without_giving_it_back_is_taken_over(tmp_path):
    rec = writer.record("ended-call", "train", None)  # this pid, a call not held any more
    (tmp_path / writer.LOCK_NAME).write_text(json.dumps(rec))
    writer.acquire(str(tmp_path), "call-d", "train").release()


def test_a_holder_on_another_host_counts_as_live_and_the_way_out_is_said(tmp_path):
    rec = dict(writer.record("far-call", "train", None), host="elsewhere", pid=1)
    (tmp_path / writer.LOCK_NAME).write_text(json.dumps(rec))
    with pytest.raises(LaunchError) as info:
        writer.acquire(str(tmp_path), "call-e", "train")
    msg = str(info.value)
    assert "on host elsewhere, pid 1" in msg and "cannot check it from here" in msg
    assert f"delete {tmp_path / writer.LOCK_NAME}" in msg
    assert writer.holder(str(tmp_path))["live"] is None


def test_an_unreadable_lock_file_is_refused_with_what_to_do(tmp_path):
    (tmp_path / writer.LOCK_NAME).write_text("not json")
    with pytest.raises(LaunchError, match="a file gangrun cannot read .*delete that file"):
        writer.acquire(str(tmp_path), "call-f", "train")


def test_an_fsspec_store_is_locked_the_same_way():
    url = f"memory://gangrun-lock-{uuid.uuid4().hex[:8]}/ckpt"
    held = writer.acquire(url, "call-g", "train")
    with pytest.raises(LaunchError, match="gangrun call call-g"):
        writer.acquire(url, "call-h", "train")
    held.release()
    writer.acquire(url, "call-h", "train").release()
    assert writer.holder(url) is None


class _Manager:
    """Stands in for a Checkpointer: the registry only keeps a weak reference to it."""


def test_one_manager_per_location_in_a_rank(tmp_path):
    where = str(tmp_path / "ckpt")
    first, second = _Manager(), _Manager()
    location.claim(where, first)
    location.claim(where, first)  # the same manager again: fine
    with pytest.raises(RuntimeError, match="already used by another Checkpointer of this rank"):
        location.claim(f"file://{where}/", second)  # the same location, spelled otherwise
    location.release(where, second)  # not its own: nothing changes
    with pytest.raises(RuntimeError, match=r"made at .*test_writer_lock\.py:\d+"):
        location.claim(where, second)
    location.release(where, first)  # close()
    location.claim(where, second)
    del second
    gc.collect()  # a manager that is gone frees its location too
    location.claim(where, _Manager())


def test_a_host_lock_excludes_another_holder_even_in_this_process():
    from gangrun.host.lock import host_lock

    with (
        host_lock("mlflow-run:abc"),
        pytest.raises(LaunchError, match="held its lock .* for over 0.05s"),
        host_lock("mlflow-run:abc", timeout=0.05),
    ):
        pass
    with host_lock("mlflow-run:abc", timeout=0.05):  # free again
        pass


@pytest.mark.parametrize("body", ["not json", '{"host": "vm", "pid": 12', '{"pid": 1}'])
def test_gangrun_checkpoints_names_an_unreadable_or_torn_lock_as_the_call_does(
    tmp_path, capsys, body
):
    from gangrun.cli.entry import main as cli

    (tmp_path / "step-1").mkdir()
    (tmp_path / "step-1" / "__0_0.distcp").write_bytes(b"z")  # a save that never committed
    path = tmp_path / writer.LOCK_NAME
    path.write_text(body)
    with pytest.raises(LaunchError) as info:
        writer.acquire(str(tmp_path), "call-t", "train")
    said = f"locked by a file gangrun cannot read ({path}). If no call writes to this location, "
    said += "delete that file"
    assert said in str(info.value), str(info.value)
    assert cli(["checkpoints", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"writer: {said}."
    assert writer.holder(str(tmp_path)) == {"live": None, "unreadable": True}
