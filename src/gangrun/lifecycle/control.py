"""The node's view of a call: its record in the run directory and its control socket.

For ``gangrun ps / logs / stacks / stop`` in another terminal (`gangrun.cli.node`), every
call of this process writes, into its private run directory (0700):

``call.json`` (0600, replaced atomically at each transition: `gangrun.wire.call`)
    run id, function, ranks and their pids, GPUs, start time, state, attempt, the MLflow run,
    the log directory, the checkpoint location it holds, and the caller: pid, process
    identity, and what it is (a Jupyter kernel, ``gangrun run``, or a Python script).
``control`` (a Unix socket, 0600; its messages: `gangrun.wire.control`)
    served by one thread of the caller for the call's lifetime. A request is one JSON line:
    ``{"op": "stop"}`` cancels the call exactly as ``handle.cancel()`` does (the same
    teardown, a ``DistributedCancelledError`` naming who stopped it, the MLflow run KILLED)
    and answers once the call has ended; ``{"op": "stacks", "timeout": S}`` answers with
    every live rank's stacks, waiting at most S seconds (default 5) for the ranks' dumps;
    ``{"op": "ping"}``. A peer of another uid (``SO_PEERCRED``) is refused before its
    request is read. The thread needs no more of the caller than the GIL, so it
    answers while the kernel's main thread is busy in a cell.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import struct
import sys
import threading
import time

from ..host.system import process_identity
from ..wire import call as call_file
from ..wire import control as messages
from ..wire.call import CallEntry
from ..wire.control import Reply, Request
from ..wire.rundir import CALL_RECORD, CONTROL_SOCKET, RunDir
from ..wire.security import redact
from .checkpoints import location
from .observers import CallView, Observer
from .state import State

log = logging.getLogger("gangrun.lifecycle.control")

RECORD = CALL_RECORD  # names owned by RunDir (rundir.py)
SOCKET = CONTROL_SOCKET
STOP_WAIT_S = 120.0  # how long a stop request waits for the call to end before answering
STACKS_WAIT_S = 5.0  # how long a stacks request waits for the ranks' dumps (its "timeout")
STACKS_WAIT_MAX_S = 600.0


def peer_uid(conn: socket.socket) -> int | None:
    try:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _pid, uid, _gid = struct.unpack("3i", creds)
        return int(uid)
    except (OSError, AttributeError):
        return None


class ControlObserver(Observer):
    """Writes the call record at each transition and serves the control socket."""

    def __init__(self, run: CallView) -> None:
        self.run = run
        self.started = time.time()
        self._sock: socket.socket | None = None
        self._wake_r = self._wake_w = -1
        self._thread: threading.Thread | None = None
        self._busy = False  # the thread is answering a request (a stop waits for the end)
        self._state = "starting"

    # ---------------------------------------------------------------- the record
    def record(self) -> CallEntry:
        run = self.run
        call, gang, tracker = run.call, run.gang, run.tracker
        return CallEntry(
            run_id=call.run_id,
            function=call.fn_name,
            world_size=call.world_size,
            gpus=[d.index for d in run.devices],
            started=self.started,
            state=self._state,
            attempt=run.attempt,
            max_restarts=call.max_restarts,
            pids={str(r): p for r, p in (dict(gang.pids) if gang is not None else {}).items()},
            log_dir=run.log_dir,
            run_dir=run.run_dir,
            mlflow_run_id=None if tracker is None else tracker.run_id,
            tracking_uri=None if tracker is None else redact(tracker.tracking_uri),
            experiment_id=None if tracker is None else tracker.experiment_id,
            checkpoint_dir=location(call.run_id),  # the location it holds (one writer)
            caller_pid=run.owner_pid,
            caller=process_identity(run.owner_pid),
            caller_kind=call.caller,  # told by what made the call (a kernel, gangrun run)
            caller_argv=[redact(str(a)) for a in sys.argv[:4]],
            uid=os.getuid(),
            control=self._sock is not None,
            updated=time.time(),
        )

    def write_record(self) -> None:
        if not self.run.run_dir or os.getpid() != self.run.owner_pid:
            return
        try:
            call_file.write(RunDir(self.run.run_dir).call_record, self.record())
        except OSError as exc:  # the run directory is gone: nothing to show any more
            log.debug("call %s: cannot write its record: %s", self.run.call.run_id, exc)

    # ---------------------------------------------------------------- observer
    def on_transition(self, state: State, run: CallView) -> None:
        self._state = state.value
        if state is State.LAUNCHING and self._sock is None and self.run.run_dir:
            self._serve()
        self.write_record()
        if state.terminal:
            self._close()

    # ---------------------------------------------------------------- the socket
    def _serve(self) -> None:
        path = RunDir(self.run.run_dir).control_socket
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(path)  # in the 0700 run directory: no one else can reach it anyway
            os.chmod(path, 0o600)  # (not umask: that would change other threads' files too)
            sock.listen(4)
        except OSError as exc:  # e.g. a path over the 107 bytes of sun_path
            sock.close()
            log.debug("call %s: no control socket (%s): gangrun stop cannot reach it", path, exc)
            return
        self._sock = sock
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(
            target=self._loop, name=f"gangrun-control-{self.run.call.run_id}", daemon=True
        )
        self._thread.start()

    def _close(self) -> None:
        """The call reached its end: stop the thread, and (unless it is answering a request,
        e.g. a ``stop`` that waits for this very end) wait for it. Once the call returns, no
        thread of it is left holding the call (its error and handle would outlive
        ``del err``, its run directory with them) nor the wake pipe's two descriptors."""
        if self._wake_w != -1:
            try:
                os.write(self._wake_w, b"x")
            except OSError:  # the loop already closed it
                pass
        thread = self._thread
        if thread is not None and thread is not threading.current_thread() and not self._busy:
            thread.join(5.0)  # bounded: the loop only waits in select() when not busy

    def _loop(self) -> None:
        sock, wake = self._sock, self._wake_r
        assert sock is not None
        try:
            while True:
                ready, _, _ = select.select([sock.fileno(), wake], [], [])
                if wake in ready:
                    return
                conn, _ = sock.accept()
                self._busy = True
                try:
                    with conn:
                        self._handle(conn)
                finally:
                    self._busy = False
        except Exception:
            log.exception("call %s: the control socket stopped", self.run.call.run_id)
        finally:
            sock.close()
            try:
                os.unlink(RunDir(self.run.run_dir).control_socket)
            except OSError:  # the run directory went first
                pass
            for fd in (self._wake_r, self._wake_w):
                try:
                    os.close(fd)
                except OSError:
                    pass
            self._wake_r = self._wake_w = -1

    def _handle(self, conn: socket.socket) -> None:
        conn.settimeout(5.0)
        uid = peer_uid(conn)
        if uid != os.getuid():
            rid = self.run.call.run_id
            log.warning("call %s: refused a control request from uid %s", rid, uid)
            _reply(conn, Reply(ok=False, error="refused: this call belongs to another user"))
            return
        try:
            req = Request.from_json(messages.read_line(conn))
        except OSError:
            return
        if req is None:
            return
        if req.op == messages.PING:
            _reply(conn, Reply(ok=True, record=self.record().to_dict()))
        elif req.op == messages.STACKS:
            try:
                got = self.run.watch.stacks(wait=_wait_s(req.timeout))
                _reply(conn, Reply(ok=True, stacks={str(r): s for r, s in got.items()}))
            except Exception as exc:
                _reply(conn, Reply(ok=False, error=str(exc)))
        elif req.op == messages.STOP:
            who = req.by
            reason = "stopped from the command line (gangrun stop" + (f", {who}" if who else "")
            log.debug("call %s: %s)", self.run.call.run_id, reason)
            self.run.cancel(reason + ")", wait=STOP_WAIT_S)  # the one teardown, as cancel()
            out, tracker = self.run.outcome, self.run.tracker
            _reply(
                conn,
                Reply(
                    ok=True,
                    done=self.run.done(),
                    state=out.state.value,
                    mlflow_status=out.mlflow_status,
                    mlflow_run_id=None if tracker is None else tracker.run_id,
                    error=None if out.error is None else str(out.error).splitlines()[0],
                ),
            )
        else:
            _reply(conn, Reply(ok=False, error=f"unknown request {req.op or None!r}"))


def _wait_s(value: float | None) -> float:
    """A request's ``timeout`` (seconds to wait for the ranks' dumps): the client's
    ``--timeout``, within 0.1 s and `STACKS_WAIT_MAX_S`; `STACKS_WAIT_S` when not given."""
    wait = value if value is not None else STACKS_WAIT_S
    if wait != wait:  # NaN
        return STACKS_WAIT_S
    return min(max(wait, 0.1), STACKS_WAIT_MAX_S)


def _reply(conn: socket.socket, msg: Reply) -> None:
    try:
        messages.send(conn, msg)
    except OSError:  # the client gave up
        pass


def attach(run: CallView) -> list[Observer]:
    return [ControlObserver(run)]


__all__ = ["ControlObserver", "RECORD", "SOCKET", "attach", "peer_uid"]
