"""Which live call uses an MLflow run: the lease tag ``gangrun.lease`` (caller side).

A call writes the tag on its run when it creates or resumes it, and removes it when it
finishes the run. Resuming a run (``run_id=``, ``MLFLOW_RUN_ID``) whose tag names a call that
still runs is a [`LaunchError`][gangrun.errors.LaunchError] before any rank starts: two calls would
log the same steps into one run and the second would end it under the first.

"Still runs" is decided without trusting the tag alone, so that a run whose caller died
(a kernel SIGKILLed: nobody removed the tag) can be resumed:

* the run is no longer ``RUNNING``: the tag is stale;
* the holder ran on this host, in this PID namespace: it is live while its process (pid and
  start time, `gangrun.host.system.process_identity`) exists, and, when that process is
  this one, while the call named in the tag has not finished here;
* another host: it cannot be checked from here, so it counts as live; the message says how to
  take the run over when that call is known to be dead.

Taking the run (`take`: check, write the tag, read it back) runs under `exclusive`, a lock of
this host (`gangrun.host.lock`), together with the run's return to ``RUNNING``: two calls of
one user on one host never both take a run, however close together they resume it. Calls on
two hosts are told apart by the read-back alone (the tag is then another call's: refused);
two that write and read back in the same instant on two hosts can still both take it. A
resumed run with checkpoints is exclusive across hosts too: its checkpoint location is
taken atomically in the storage itself (`gangrun.checkpoint.writer`).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
from typing import Any

from ..errors import LaunchError
from ..host.system import process_identity
from ..wire.records import pid_namespace
from ..wire.tags import TAG_LEASE

_lock = threading.Lock()
_held: set[str] = set()  # the call ids of this process whose runs are still in use


def value(call_id: str) -> str:
    """The tag's value for call ``call_id`` of this process."""
    return json.dumps(
        {
            "host": socket.gethostname(),
            "pid_ns": pid_namespace(),
            "pid": os.getpid(),
            "caller": process_identity(os.getpid()),
            "call": call_id,
        },
        sort_keys=True,
    )


def hold(call_id: str) -> None:
    with _lock:
        _held.add(call_id)


def release(call_id: str) -> None:
    with _lock:
        _held.discard(call_id)


def holder(run: Any) -> dict[str, Any] | None:
    """The live call that holds ``run`` (an ``mlflow.entities.Run``), or ``None``."""
    raw = run.data.tags.get(TAG_LEASE)
    if not raw or run.info.status != "RUNNING":
        return None
    try:
        lease = json.loads(raw)
        pid = int(lease["pid"])
    except (ValueError, TypeError, KeyError):
        return None  # not written by gangrun: no claim
    if not isinstance(lease, dict):
        return None
    if lease.get("host") == socket.gethostname() and lease.get("pid_ns") == pid_namespace():
        if process_identity(pid) != lease.get("caller"):
            return None  # that caller is gone (SIGKILLed, a kernel restart)
        if pid == os.getpid():
            with _lock:
                return lease if lease.get("call") in _held else None
    return lease


def exclusive(run_id: str) -> contextlib.AbstractContextManager[None]:
    """The section of this host in which run ``run_id`` is taken (see the module)."""
    from ..host.lock import host_lock

    return host_lock(f"mlflow-run:{run_id}")


def take(client: Any, run_id: str, mine: str, call_id: str, where: str) -> Any:
    """Take run ``run_id`` for call ``call_id`` (``mine``: its `value`), under `exclusive`:
    the run as read back once it is this call's; a LaunchError naming its live holder."""
    check(client.get_run(run_id), where)  # a live call's run: refused before anything changes
    client.set_tag(run_id, TAG_LEASE, mine)
    run = client.get_run(run_id)
    if run.data.tags.get(TAG_LEASE) != mine:  # a call on another host wrote its own meanwhile
        check(run, where)
        raise LaunchError(
            f"{where}: another call took that MLflow run at the same moment as this one. Two "
            "calls in one run would log the same steps and end it under each other; resume it "
            "once that call has ended."
        )
    hold(call_id)
    return run


def check(run: Any, where: str) -> None:
    """Raise [`LaunchError`][gangrun.errors.LaunchError] when a live call uses ``run``."""
    lease = holder(run)
    if lease is None:
        return
    run_id = run.info.run_id
    host, pid = lease.get("host", "?"), lease.get("pid", "?")
    here = lease.get("host") == socket.gethostname() and lease.get("pid_ns") == pid_namespace()
    how = (
        "Wait for that call to end (or stop it), then resume the run."
        if here
        else (
            "It runs on another machine, so gangrun cannot check it from here: once that call "
            f"is known to be dead, MlflowClient().delete_tag({run_id!r}, {TAG_LEASE!r}) lets "
            "this call take the run over."
        )
    )
    own = " (this process)" if here and pid == os.getpid() else ""
    raise LaunchError(
        f"{where}: that MLflow run is in use by a running call (gangrun call "
        f"{lease.get('call', '?')} on host {host}, pid {pid}{own}). Two calls in one run would "
        f"log the same steps and end it under each other. {how}"
    )


__all__ = ["TAG_LEASE", "value", "hold", "release", "holder", "check", "exclusive", "take"]
