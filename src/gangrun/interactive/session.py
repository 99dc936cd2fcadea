"""The caller's side of an interactive gang: `Gang`.

A gang is one ordinary call of `gangrun.interactive.rank.gang` with ``timeout=None``,
started through the public ``distributed(...).submit(...)``: launch, output streaming into the
caller's ``sys.stdout`` (the running cell, in a notebook), the liveness pipe (the caller's death
kills the ranks), teardown, root cause and the MLflow run (one per gang) all come from there.
Each rank connects back over an AF_UNIX socket in a private (0700) directory, proves it knows
the gang's random token, and then serves commands: see `gangrun.interactive.protocol`.
"""

from __future__ import annotations

import atexit
import dataclasses
import hmac
import itertools
import logging
import os
import pickle
import secrets
import selectors
import shutil
import signal
import socket
import tempfile
import threading
import time
import weakref
from typing import Any

from .. import serialization
from ..api import RunHandle, distributed
from ..errors import DistributedError, DistributedTimeoutError, LaunchError
from ..options import DEFAULT_TIMEOUT, Options
from . import protocol
from .outcome import PerRank, failure
from .rank import HELLO, gang

log = logging.getLogger("gangrun.interactive")

_cells = itertools.count(1)
_live: weakref.WeakSet[Gang] = weakref.WeakSet()
_last: weakref.ReferenceType[Gang] | None = None
POLL_S = 0.25
DRAIN_S = 1.0


def last_gang() -> Gang | None:
    """The gang created last in this process (``%%distributed`` without a name uses it)."""
    return None if _last is None else _last()


def _release(socks: dict[int, socket.socket], path: str) -> None:
    """Close the ranks' connections (a rank that sees EOF ends its call) and the socket dir."""
    for s in socks.values():
        try:
            s.close()
        except OSError:
            log.debug("closing a gang socket failed", exc_info=True)
    socks.clear()
    if path:
        shutil.rmtree(path, ignore_errors=True)


class Gang:
    """Ranks that stay alive across executions, each with a persistent namespace.

    Takes the options of ``@distributed`` (``processes=``/``gpus=``, ``gpu_type``, ``env``,
    ``mlflow``, ``output``, ...); ``timeout`` is per execution. ``interrupt_grace`` is how
    long interrupted or timed-out ranks get to come back before they are killed (the gang is
    then broken until `restart`); ``start_timeout`` bounds the ranks' start.

    >>> g = Gang(processes=2)
    >>> g.execute("import os; r = int(os.environ['RANK'])")
    >>> g.execute("r * 10")
    [0, 10]
    """

    def __init__(
        self, *, interrupt_grace: float = 1.5, start_timeout: float = 300.0, **options: Any
    ) -> None:
        global _last
        if options.get("max_restarts"):
            raise LaunchError("max_restarts is not supported by Gang: use g.restart().")
        if options.get("hang_timeout") is not None:
            raise LaunchError(
                "hang_timeout is not supported by Gang (an idle gang is silent by design); "
                "use timeout=, which is per execution."
            )
        if options.get("backend", "local") != "local":
            raise LaunchError("Gang runs on this node only for now (backend='local').")
        self.timeout: float | None = options.pop("timeout", DEFAULT_TIMEOUT)
        Options(timeout=self.timeout).validate()
        self._fn = distributed(timeout=None, **options)(gang)
        self.options: Options = dataclasses.replace(self._fn.settings, timeout=self.timeout)
        self.interrupt_grace = float(interrupt_grace)
        self.start_timeout = float(start_timeout)
        self._lock = threading.Lock()
        self._handle: RunHandle[None] | None = None
        self._socks: dict[int, socket.socket] = {}
        self._pids: dict[int, int] = {}
        self._dir = ""
        self._closed = True
        self._broken: str | None = None
        self._extra: dict[int, int] = {}
        self._finalizer: Any = None
        self._start()
        _live.add(self)
        _last = weakref.ref(self)

    # ------------------------------------------------------------------ lifecycle
    @property
    def world_size(self) -> int:
        return len(self._socks) if self._handle is None else self._handle.world_size

    @property
    def handle(self) -> RunHandle[None] | None:
        """The gang's call: ``.mlflow_run_id``, ``.logs(rank)``, ``.log_dir``."""
        return self._handle

    @property
    def pids(self) -> dict[int, int]:
        return dict(self._pids)

    def _start(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="gangrun-gang-")
        os.chmod(self._dir, 0o700)
        path = os.path.join(self._dir, "s")
        token = secrets.token_hex(16)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        socks: dict[int, socket.socket] = {}
        try:
            listener.bind(path)
            listener.listen(64)
            listener.settimeout(POLL_S)
            self._handle = self._fn.submit(path, token)
            self._accept(listener, token, socks)
        except BaseException:
            _release(socks, self._dir)
            if self._handle is not None:
                self._handle.cancel()
            raise
        finally:
            listener.close()
        self._socks = socks
        self._extra = {r: 0 for r in socks}
        self._closed = False
        self._broken = None
        self._finalizer = weakref.finalize(self, _release, socks, self._dir)

    def _accept(self, listener: socket.socket, token: str, socks: dict[int, socket.socket]) -> None:
        assert self._handle is not None
        n = self._handle.world_size
        deadline = time.monotonic() + self.start_timeout
        while len(socks) < n:
            if self._handle.done():
                try:
                    self._handle.result(timeout=0)
                except DistributedError as err:
                    raise DistributedError(
                        f"the gang's ranks ended while starting: {err}",
                        rank=err.rank,
                        exitcode=err.exitcode,
                        traceback=err.traceback,
                    ) from err
                raise DistributedError("the gang's ranks ended while starting.")
            if time.monotonic() > deadline:
                raise DistributedTimeoutError(
                    f"only {len(socks)} of {n} ranks of the gang started within "
                    f"start_timeout={self.start_timeout:g}s; the gang was stopped."
                )
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            conn.settimeout(10.0)
            try:
                head = protocol._recv_exact(conn, HELLO.size)
            except OSError:
                head = None
            if head is None:
                conn.close()
                continue
            got, rank, pid = HELLO.unpack(head)
            if not hmac.compare_digest(got, token.encode("ascii")) or not 0 <= rank < n:
                log.warning("gang: refused a connection that did not present the gang's token")
                conn.close()
                continue
            conn.settimeout(None)
            socks[rank] = conn
            self._pids[rank] = pid

    def close(self, timeout: float = 30.0) -> None:
        """End the gang: every rank leaves, the MLflow run ends FINISHED. Idempotent."""
        with self._lock:
            self._close(timeout)

    def _close(self, timeout: float = 30.0) -> None:
        if self._closed:
            return
        self._closed = True
        handle = self._handle
        for s in self._socks.values():
            try:
                protocol.send(s, ("close",))
            except OSError:
                log.debug("gang: rank connection already gone at close", exc_info=True)
        _release(self._socks, self._dir)
        if handle is not None and not self._broken:
            try:
                handle.result(timeout=timeout)
            except TimeoutError:
                log.warning("gang: ranks did not leave within %ss; stopping them", timeout)
                handle.cancel()
            except DistributedError as err:
                log.warning("gang: the ranks failed while closing: %s", err)
        _live.discard(self)

    def restart(self) -> None:
        """Fresh ranks with the same options (every rank's state is lost)."""
        with self._lock:
            self._close()
            self._pids = {}
            self._start()
            _live.add(self)

    def __enter__(self) -> Gang:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("broken" if self._broken else "running")
        return f"<gangrun.Gang world_size={self.world_size} {state}>"

    # ------------------------------------------------------------------ executions
    def execute(self, code: str) -> list[Any]:
        """Run ``code`` on every rank in its persistent namespace; the value of its last
        expression per rank, in rank order (``None`` where it ends in a statement)."""
        __tracebackhide__ = True  # IPython: show the ranks' error, not this frame
        if not isinstance(code, str):
            raise TypeError(f"execute() takes the code as a string, got {type(code).__name__}")
        cell = next(_cells)
        protocol.compile_cell(code, protocol.cell_filename(cell))  # SyntaxError here, first
        return self._exchange(("exec", cell, code), "the execution")

    def run(self, fn: Any, *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``fn(*args, **kwargs)`` on every warm rank; per-rank results in rank order.
        Inside, `gangrun.rank_state` is the namespace that `execute` uses."""
        __tracebackhide__ = True
        if not callable(fn):
            raise LaunchError(f"Gang.run takes a function, got {fn!r}")
        limit = self.options.max_capture_bytes
        try:
            payload = serialization.dumps((fn, args, kwargs))
        except Exception as exc:
            raise serialization._unpicklable(fn, args, kwargs, exc) from exc
        if limit is not None and len(payload) > limit:
            raise serialization._too_large(fn, args, kwargs, limit)
        name = getattr(fn, "__qualname__", repr(fn))
        return self._exchange(("run", payload), f"{name}()")

    def _check_usable(self) -> RunHandle[None]:
        if self._broken:
            raise DistributedError(
                f"this gang is broken ({self._broken}); its ranks were stopped. Call "
                "g.restart() for fresh ranks (their state is lost)."
            )
        if self._closed:
            raise DistributedError(
                "this gang is closed. Call g.restart() for fresh ranks, or create a new "
                "gangrun.Gang(...)."
            )
        assert self._handle is not None
        if self._handle.done():
            self._died(None)
        return self._handle

    def _exchange(self, msg: tuple, what: str) -> PerRank:
        __tracebackhide__ = True  # IPython: show the ranks' error, not this frame
        if not self._lock.acquire(blocking=False):
            raise DistributedError(
                "another execution is running on this gang; wait for it (one at a time)."
            )
        try:
            handle = self._check_usable()
            # in a kernel: this execution's output belongs to the cell running it now
            for stream in (handle._run.stdout, handle._run.stderr):
                retarget = getattr(stream, "retarget", None)
                if retarget is not None:
                    retarget()
            limit = self.timeout
            deadline = None if limit is None else time.monotonic() + limit
            data = protocol.frame(msg)
            pending = set(self._socks)
            replies: dict[int, tuple] = {}
            readers = {r: protocol.Reader() for r in pending}
            stopped: str | None = None
            try:
                for r, s in self._socks.items():
                    try:
                        s.sendall(data)
                    except OSError:
                        self._died(r)
                self._gather(pending, replies, readers, deadline)
                if pending:
                    stopped = "timeout"
            except KeyboardInterrupt:
                stopped = "interrupt"
            if stopped:
                self._interrupt(pending, replies, readers, stopped, limit)
            self._drain(handle, replies)
            return self._outcome(replies, what, stopped, limit)
        finally:
            self._lock.release()

    def _gather(
        self,
        pending: set[int],
        replies: dict[int, tuple],
        readers: dict[int, protocol.Reader],
        until: float | None,
    ) -> None:
        """Read replies until every pending rank answered or ``until`` passed."""
        assert self._handle is not None
        sel = selectors.DefaultSelector()
        try:
            for r in pending:
                sel.register(self._socks[r], selectors.EVENT_READ, r)
            while pending:
                wait = POLL_S if until is None else min(POLL_S, until - time.monotonic())
                if wait <= 0:
                    return
                for key, _ in sel.select(wait):
                    r = key.data
                    try:
                        data = self._socks[r].recv(1 << 20)
                    except OSError:
                        data = b""
                    if not data:
                        self._died(r)
                    for m in readers[r].feed(data):
                        replies[r] = m
                        pending.discard(r)
                        sel.unregister(self._socks[r])
                if pending and self._handle.done():
                    self._died(None)
        finally:
            sel.close()

    def _interrupt(
        self,
        pending: set[int],
        replies: dict[int, tuple],
        readers: dict[int, protocol.Reader],
        why: str,
        limit: float | None,
    ) -> None:
        """SIGINT the ranks still running; kill those not back within the grace period."""
        __tracebackhide__ = True
        for r in sorted(pending):
            try:
                os.kill(self._pids[r], signal.SIGINT)
            except ProcessLookupError:
                log.debug("gang: rank %d already gone when interrupted", r)
        try:
            self._gather(pending, replies, readers, time.monotonic() + self.interrupt_grace)
        except KeyboardInterrupt:
            log.debug("gang: interrupted again while ranks stopped; killing the stragglers")
        if not pending:
            return
        for r in sorted(pending):
            try:
                os.kill(self._pids[r], signal.SIGKILL)
            except ProcessLookupError:
                log.debug("gang: rank %d already gone when killed", r)
        ranks = ", ".join(map(str, sorted(pending)))
        self._stop(f"rank(s) {ranks} did not stop within {self.interrupt_grace:g}s")
        msg = (
            f"rank(s) {ranks} did not stop within interrupt_grace={self.interrupt_grace:g}s "
            "and were killed; the gang is broken: call g.restart() for fresh ranks."
        )
        if why == "timeout":
            raise DistributedTimeoutError(
                f"the execution did not finish within timeout={limit:g}s; {msg}",
                rank=min(pending),
            )
        raise KeyboardInterrupt(msg)

    def _stop(self, reason: str) -> DistributedError | None:
        """The gang broke: wait for the call's teardown (it stops every rank), release."""
        self._broken = reason
        handle = self._handle
        err: DistributedError | None = None
        if handle is not None:
            try:
                handle.result(timeout=3.0 + self.options.grace_period)
            except TimeoutError:
                handle.cancel()
            except DistributedError as e:
                err = e
            if err is None:
                try:
                    handle.result(timeout=0)
                except (DistributedError, TimeoutError) as e:
                    err = e if isinstance(e, DistributedError) else None
        _release(self._socks, self._dir)
        self._closed = True
        _live.discard(self)
        return err

    def _died(self, rank: int | None) -> None:
        """A rank ended (its connection closed, or the call ended): raise naming it."""
        who = "a rank" if rank is None else f"rank {rank}"
        err = self._stop(f"{who} died")
        if err is not None and err.rank is not None:
            who = f"rank {err.rank}"
            self._broken = f"{who} died"
        detail = f": {err}" if err is not None else "."
        raise DistributedError(
            f"{who} of the gang died{detail}\nThe other ranks were stopped and the gang is "
            "broken: call g.restart() for fresh ranks (their state is lost).",
            rank=rank if err is None else err.rank,
            exitcode=None if err is None else err.exitcode,
            traceback=None if err is None else err.traceback,
            exc_type=None if err is None else err.exc_type,
            run_id=None if err is None else err.run_id,
        ) from err

    def _drain(self, handle: RunHandle[None], replies: dict[int, tuple]) -> None:
        """Wait (briefly) until what each rank printed has reached the caller's output."""
        until = time.monotonic() + DRAIN_S
        for r, reply in replies.items():
            want = reply[-1] + self._extra.get(r, 0)
            path = os.path.join(handle.log_dir, f"rank-{r}.log")
            size = 0
            while True:
                try:
                    size = os.stat(path).st_size
                except OSError:
                    break
                if size >= want or time.monotonic() > until:
                    break
                time.sleep(0.002)
            self._extra[r] = max(self._extra.get(r, 0), size - reply[-1])

    def _outcome(
        self, replies: dict[int, tuple], what: str, stopped: str | None, limit: float | None
    ) -> PerRank:
        __tracebackhide__ = True
        values = PerRank([None] * len(self._socks))
        failed: dict[int, dict[str, Any]] = {}
        for r in sorted(replies):
            kind, body = replies[r][0], replies[r][1]
            if kind == "err":
                failed[r] = body
                continue
            try:
                values[r] = None if body is None else pickle.loads(body)
            except Exception as exc:
                failed[r] = {
                    "exc_type": type(exc).__name__,
                    "message": f"rank {r}'s value cannot be loaded here: {exc}",
                    "traceback": f"{type(exc).__name__}: {exc}\n",
                }
        if stopped == "interrupt":
            raise KeyboardInterrupt(f"{what} was interrupted on every rank; the gang is usable.")
        if stopped == "timeout":
            raise DistributedTimeoutError(
                f"{what} did not finish within timeout={limit:g}s; every rank was interrupted "
                "and the gang is still usable."
            )
        if failed:
            raise failure(
                failed, values, what, None if self._handle is None else self._handle.run_id
            )
        return values


def _close_all() -> None:
    for g in list(_live):
        try:
            g.close(timeout=10.0)
        except Exception:  # at exit: the call machinery's own stop_all still runs after this
            log.warning("gang: closing at exit failed", exc_info=True)


atexit.register(_close_all)
