"""One writer per checkpoint location: the lock file ``<location>/.gangrun-writer``.

A call with a checkpoint location (``checkpoint_dir=``, or the one its resumed MLflow run
recorded) takes it in its caller before any rank starts (`gangrun.lifecycle.checkpoints`)
and gives it back when the call ends, however it ends; its restarts keep it. The file names
the holder (JSON): host, PID namespace, pid and process identity of the caller, the gangrun
call and function, the MLflow run, the time. A second call on the location, from any process
of any user of the same storage, gets a `LaunchError` naming it.

Taking it is one atomic create: on a local or mounted file system the record is written to a
temporary name and hard-linked to the lock's name (``link`` fails if the lock exists; where
hard links are not supported, ``O_CREAT | O_EXCL``); on an fsspec store it is written with
``mode="create"`` (an S3 conditional put on AWS S3 with s3fs, ``xb`` on ``memory://``), then
read back: a store without an atomic create (gangrun then falls back to "write if absent"),
written by two callers in the same instant, can let both believe they hold it. That is the
one limit.

A holder that died is taken over: one on this host, in this PID namespace, whose process
(pid and start time) is gone, or one of this process whose call has ended. Taking over runs
under this host's `gangrun.host.lock` lock, so two callers of one user never both take over
one dead holder. A holder on another host (or in another PID namespace) cannot be checked: it
counts as live, and the error says to delete the lock file once that call is known dead.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from ..errors import LaunchError
from ..host.system import process_identity
from ..wire.records import pid_namespace

LOCK_NAME = ".gangrun-writer"
_TRIES = 5
_lock = threading.Lock()
# lock path -> the calls of this process holding it or about to: registered before the create,
# so that another thread of this process never takes a just-created lock for a dead one's
_held: dict[str, set[str]] = {}


@dataclass
class WriterLock:
    """A held location; `release` gives it back (idempotent)."""

    url: str
    path: str  # the lock file, in the store's own spelling
    body: bytes
    storage_options: dict[str, Any]
    call_id: str
    released: bool = False

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        from ..host.lock import host_lock

        fs, local = _fs(self.url, self.storage_options)
        with host_lock(f"writer:{self.path}"):
            try:
                if _read(fs, local, self.path) == self.body:  # still ours: remove it
                    _remove(fs, local, self.path)
            finally:
                _forget(self.path, self.call_id)


def _fs(url: str, storage_options: dict[str, Any]) -> tuple[Any, bool]:
    """The store, and whether it is this machine's file system (then `os` does the work)."""
    from . import filesystem

    fs, _ = filesystem(url, storage_options)
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    return fs, bool({"file", "local"} & set(protocols))


def lock_path(url: str, storage_options: dict[str, Any] | None = None) -> str:
    from . import filesystem

    _, path = filesystem(url, storage_options)
    return path.rstrip("/") + "/" + LOCK_NAME


def record(call_id: str, function: str, mlflow_run_id: str | None) -> dict[str, Any]:
    """What the lock file says of this process's call ``call_id``."""
    return {
        "host": socket.gethostname(),
        "pid_ns": pid_namespace(),
        "pid": os.getpid(),
        "caller": process_identity(os.getpid()),
        "call": call_id,
        "function": function,
        "mlflow_run_id": mlflow_run_id,
        "time": time.time(),
    }


def liveness(rec: dict[str, Any], path: str) -> bool | None:
    """True: the holder lives; False: it died (take it over); None: it cannot be checked
    from here (another host or PID namespace)."""
    if rec.get("host") != socket.gethostname() or rec.get("pid_ns") != pid_namespace():
        return None
    try:
        pid = int(rec["pid"])
    except (KeyError, TypeError, ValueError):
        return None
    ident = process_identity(pid)
    if ident is None and _exists(pid):
        return True  # another user's process /proc does not show (hidepid): it is there
    if ident != rec.get("caller"):
        return False  # that caller is gone (SIGKILLed, a kernel restart)
    if pid == os.getpid():
        with _lock:
            return rec.get("call") in _held.get(path, ())
    return True


def _forget(path: str, call_id: str) -> None:
    with _lock:
        calls = _held.get(path, set())
        calls.discard(call_id)
        if not calls:
            _held.pop(path, None)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def acquire(
    url: str,
    call_id: str,
    function: str,
    mlflow_run_id: str | None = None,
    storage_options: dict[str, Any] | None = None,
) -> WriterLock:
    """Take location ``url`` for call ``call_id`` of this process, or raise `LaunchError`
    naming its live holder."""
    so = dict(storage_options or {})
    fs, local = _fs(url, so)
    path = lock_path(url, so)
    body = json.dumps(record(call_id, function, mlflow_run_id), sort_keys=True).encode()
    with _lock:
        _held.setdefault(path, set()).add(call_id)
    try:
        return _take(fs, local, WriterLock(url, path, body, so, call_id))
    except BaseException:
        _forget(path, call_id)
        raise


def _take(fs: Any, local: bool, lock: WriterLock) -> WriterLock:
    from ..host.lock import host_lock

    url, path = lock.url, lock.path
    for _ in range(_TRIES):
        if _create(fs, local, path, lock.body):
            return lock
        raw = _read_settled(fs, local, path)
        if raw is None:
            continue  # released meanwhile: try again
        rec = _parse(raw)
        live = None if rec is None else liveness(rec, path)
        if live is False:
            with host_lock(f"writer:{path}"):  # one taker at a time; then the create races
                if _read(fs, local, path) == raw:
                    _remove(fs, local, path)
            continue
        raise LaunchError(in_use_message(url, path, rec, live))
    raise LaunchError(
        f"checkpoint_dir={url!r}: its lock file {path} kept changing while this call tried to "
        f"take it ({_TRIES} times): other calls are starting on this location. Try again."
    )


def holder(url: str, storage_options: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The record of the call holding ``url`` (with ``"live"``: True, False for a dead
    holder, None when it cannot be checked from here), or None when nobody holds it. A lock
    file that cannot be read (torn, not gangrun's), once given the time `acquire` gives it
    to be complete: ``{"live": None, "unreadable": True}``."""
    so = dict(storage_options or {})
    fs, local = _fs(url, so)
    path = lock_path(url, so)
    raw = _read_settled(fs, local, path)
    if raw is None:
        return None
    rec = _parse(raw)
    if rec is None:
        return {"live": None, "unreadable": True}
    return dict(rec, live=liveness(rec, path))


def unreadable_lock(path: str) -> str:
    """What a lock file gangrun cannot read means, and what to do (the call's refusal and
    ``gangrun checkpoints`` say it alike)."""
    return (
        f"locked by a file gangrun cannot read ({path}). If no call writes to this location, "
        "delete that file"
    )


def in_use_message(url: str, path: str, rec: dict[str, Any] | None, live: bool | None) -> str:
    if rec is None:
        return f"checkpoint_dir={url!r} is {unreadable_lock(path)} and try again."
    fn, call, mlflow_id = (
        rec.get("function") or "?",
        rec.get("call") or "?",
        rec.get("mlflow_run_id"),
    )
    host, pid = rec.get("host", "?"), rec.get("pid", "?")
    own = " (this process)" if live and pid == os.getpid() else ""
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(rec.get("time") or 0)))
    tracked = f", MLflow run {mlflow_id}" if mlflow_id else ""
    if live is None:
        how = (
            "It runs on another machine (or in another PID namespace), so gangrun cannot check "
            f"it from here: once that call is known to be dead, delete {path} and this call "
            "takes the location over."
        )
    else:
        how = (
            f"Wait for that call to end (or stop it: gangrun stop {call}), or give this call "
            "another checkpoint_dir."
        )
    return (
        f"checkpoint_dir={url!r} is in use by a running call: {fn} (gangrun call {call}"
        f"{tracked}) on host {host}, pid {pid}{own}, since {since}. Two calls writing one "
        "location would overwrite each other's checkpoints and resume from each other's "
        f"steps. {how}"
    )


# ---------------------------------------------------------------------- the store
def _create(fs: Any, local: bool, path: str, body: bytes) -> bool:
    """Create the lock file holding ``body``, atomically; False if it exists."""
    if local:
        return _create_local(path, body)
    try:
        fs.pipe_file(path, body, mode="create")
    except FileExistsError:
        return False
    except (TypeError, NotImplementedError):  # an fsspec without mode="create": not atomic
        fs.invalidate_cache(path)
        if fs.exists(path):
            return False
        fs.pipe_file(path, body)
    return _read(fs, local, path) == body  # another writer in the same instant: theirs


def _create_local(path: str, body: bytes) -> bool:
    tmp = f"{path}.{uuid.uuid4().hex[:12]}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, body)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)  # atomic, and the record is complete the moment it appears
        return True
    except FileExistsError:
        return False
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV):
            raise
    finally:
        os.unlink(tmp)
    try:  # no hard links here: an exclusive create, then the record (read settles on it)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    except FileExistsError:
        return False
    try:
        os.write(fd, body)
    finally:
        os.close(fd)
    return True


def _read(fs: Any, local: bool, path: str) -> bytes | None:
    try:
        if local:
            with open(path, "rb") as f:
                return f.read(1 << 16)
        fs.invalidate_cache(path)
        return bytes(fs.cat_file(path))
    except FileNotFoundError:
        return None


def _read_settled(fs: Any, local: bool, path: str) -> bytes | None:
    """The lock file's content, given up to a second to be complete (an exclusive create
    without hard links writes the record just after)."""
    deadline = time.monotonic() + 1.0
    while True:
        raw = _read(fs, local, path)
        if raw is None or _parse(raw) is not None or time.monotonic() >= deadline:
            return raw
        time.sleep(0.05)


def _parse(raw: bytes) -> dict[str, Any] | None:
    try:
        rec = json.loads(raw)
    except ValueError:
        return None
    return rec if isinstance(rec, dict) and "call" in rec else None


def _remove(fs: Any, local: bool, path: str) -> None:
    try:
        if local:
            os.unlink(path)
        else:
            fs.rm_file(path)
    except FileNotFoundError:
        pass


__all__ = [
    "LOCK_NAME",
    "WriterLock",
    "acquire",
    "holder",
    "liveness",
    "lock_path",
    "record",
    "unreadable_lock",
]
