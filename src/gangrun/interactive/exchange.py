"""One execution on every rank of a `Gang`: send, gather the replies (bounded
by the gang's ``timeout``, watched by its ``hang_timeout``), interrupt what did not come
back, wait for the ranks' output to reach the cell, and turn the replies into values or an
error. A mixin of `Gang` (its state lives there).
"""

from __future__ import annotations

import linecache
import logging
import os
import pickle
import selectors
import signal
import socket
import time

from ..api import RunHandle
from ..errors import DistributedError, DistributedHangError, DistributedTimeoutError
from ..lifecycle.hang import AUTO_MIN_S, HangGuard
from ..lifecycle.verdict import where_section
from ..notebook.routing import CellWriter
from ..rank import interactive_protocol as protocol
from ..wire.records import ErrorRecord
from .outcome import PerRank, failure

log = logging.getLogger("gangrun.interactive")
POLL_S = 0.25
DRAIN_S = 1.0


class Exchanges:
    """The execution half of a gang (see the module)."""

    _socks: dict[int, socket.socket]
    _handle: RunHandle[None] | None
    _extra: dict[int, int]
    timeout: float | None
    hang_timeout: float | str | None
    interrupt_grace: float

    # provided by the gang
    def _died(self, rank: int | None) -> None:
        raise NotImplementedError

    def _stop(self, reason: str) -> DistributedError | None:
        raise NotImplementedError

    def _check_usable(self) -> RunHandle[None]:
        raise NotImplementedError

    def _signal(self, rank: int, sig: int) -> None:
        raise NotImplementedError

    def _try_lock(self) -> bool:
        raise NotImplementedError

    def _unlock(self) -> None:
        raise NotImplementedError

    def _nodes_elsewhere(self) -> dict[int, str]:
        raise NotImplementedError

    def _exchange(self, msg: protocol.Command, what: str) -> PerRank:
        __tracebackhide__ = True  # IPython: show the ranks' error, not this frame
        if not self._try_lock():
            raise DistributedError(
                "another execution is running on this gang; wait for it (one at a time)."
            )
        try:
            handle = self._check_usable()
            # in a kernel: this execution's output belongs to the cell running it now
            for stream in (handle.supervisor.call.stdout, handle.supervisor.call.stderr):
                if isinstance(stream, CellWriter):
                    stream.retarget()
            if isinstance(msg, protocol.Exec):  # the verdict quotes the cell's lines
                source = msg.source
                linecache.cache[protocol.cell_filename(msg.cell_id)] = (
                    len(source),
                    None,
                    source.splitlines(True),
                    protocol.cell_filename(msg.cell_id),
                )
            limit = self.timeout
            deadline = None if limit is None else time.monotonic() + limit
            data = protocol.frame(msg)
            pending = set(self._socks)
            replies: dict[int, protocol.Reply] = {}
            readers = {r: protocol.Reader() for r in pending}
            stopped: str | None = None
            self._guard = self._new_guard(handle)
            try:
                for r, s in self._socks.items():
                    try:
                        s.sendall(data)
                    except OSError:
                        self._died(r)
                stopped = self._gather(pending, replies, readers, deadline, watch=True)
                if pending and stopped is None:
                    stopped = "timeout"
            except KeyboardInterrupt:
                stopped = "interrupt"
            if stopped:
                self._interrupt(pending, replies, readers, stopped, limit)
                stopped = "hang" if stopped == "silent" else stopped
            self._drain(handle, replies)
            return self._outcome(replies, what, stopped, limit)
        finally:
            self._unlock()

    def _new_guard(self, handle: RunHandle[None]) -> HangGuard | None:
        """This execution's hang verdict (``None``: ranks elsewhere, or no run directory)."""
        run_dir = handle.supervisor.run_dir
        if not run_dir or self._nodes_elsewhere():
            return None
        return HangGuard(run_dir, handle.log_dir, len(self._socks), self.hang_timeout)

    def _rank_pids(self) -> dict[int, int]:
        raise NotImplementedError

    def _progress(self, ranks: set[int]) -> dict[int, int]:
        """Ranks on other nodes (no record or process visible here): what each has shown of
        itself, the bytes of output in its log (forwarded from any node)."""
        assert self._handle is not None
        out: dict[int, int] = {}
        for r in ranks:
            try:
                st = os.stat(os.path.join(self._handle.log_dir, f"rank-{r}.log"))
                out[r] = st.st_size + st.st_mtime_ns
            except OSError:
                out[r] = 0
        return out

    def _gather(
        self,
        pending: set[int],
        replies: dict[int, protocol.Reply],
        readers: dict[int, protocol.Reader],
        until: float | None,
        watch: bool = False,
    ) -> str | None:
        """Read replies until every pending rank answered or ``until`` passed; ``"hang"``
        when ``watch`` and the pending ranks made no progress for ``hang_timeout``."""
        assert self._handle is not None
        guard = self._guard if watch and self._guard is not None and self._guard.on else None
        # ranks on other nodes: no record to read, their silence stands in for the verdict
        silence = None
        if watch and self._guard is None and self.hang_timeout is not None:
            silence = AUTO_MIN_S if self.hang_timeout == "auto" else float(self.hang_timeout)
        seen = self._progress(pending) if silence else {}
        quiet_since = {r: time.monotonic() for r in pending}
        sel = selectors.DefaultSelector()
        try:
            for r in pending:
                sel.register(self._socks[r], selectors.EVENT_READ, r)
            while pending:
                wait = POLL_S if until is None else min(POLL_S, until - time.monotonic())
                if wait <= 0:
                    return None
                for key, _ in sel.select(wait):
                    r = key.data
                    try:
                        data = self._socks[r].recv(1 << 20)
                    except OSError:
                        data = b""
                    if not data:
                        self._died(r)
                    for m in readers[r].feed(data):
                        if not isinstance(m, (protocol.Ok, protocol.Err)):
                            raise ValueError(f"rank {r} sent {type(m).__name__}, not a reply")
                        replies[r] = m
                        pending.discard(r)
                        sel.unregister(self._socks[r])
                if pending and self._handle.done():
                    self._died(None)
                if guard is not None and pending:
                    ranks, pids = sorted(self._socks), self._rank_pids()
                    if guard.check(ranks, pids):
                        guard.dump_stacks(pids, ranks)
                        return "hang"
                if silence and pending:
                    now, cur = time.monotonic(), self._progress(pending)
                    for r in pending:
                        if cur.get(r) != seen.get(r):
                            seen[r], quiet_since[r] = cur[r], now
                    if all(now - quiet_since[r] > silence for r in pending):
                        return "silent"
            return None
        finally:
            sel.close()

    def _interrupt(
        self,
        pending: set[int],
        replies: dict[int, protocol.Reply],
        readers: dict[int, protocol.Reader],
        why: str,
        limit: float | None,
    ) -> None:
        """SIGINT the ranks still running (after their stacks, for a hang); kill those not
        back within the grace period."""
        __tracebackhide__ = True
        guard = self._guard
        if why == "timeout" and guard is not None:  # where each rank was
            guard.explain(self._rank_pids(), sorted(self._socks))
        if why == "hang" and guard is not None:
            run_id = None if self._handle is None else self._handle.run_id
            log_dir = "" if self._handle is None else self._handle.log_dir
            self._hang_error = guard.error(
                "the execution", run_id, log_dir, "The execution was interrupted on every rank."
            )
        if why == "silent":  # ranks elsewhere: their stacks print into the cell
            for r in sorted(pending):
                self._signal(r, signal.SIGUSR1)
            time.sleep(0.2)
            self._hang_error = DistributedHangError(
                f"the execution made no progress on rank(s) {', '.join(map(str, sorted(pending)))}"
                f" (ranks on other nodes: no output) for hang_timeout={self.hang_timeout}; their "
                "stacks are printed above (and in g.handle.logs(rank)). The execution was "
                "interrupted.",
                rank=min(pending),
                ranks=sorted(pending),
            )
        for r in sorted(pending):
            self._signal(r, signal.SIGINT)
        try:
            self._gather(pending, replies, readers, time.monotonic() + self.interrupt_grace)
        except KeyboardInterrupt:
            log.debug("gang: interrupted again while ranks stopped; killing the stragglers")
        if not pending:
            return
        for r in sorted(pending):
            self._signal(r, signal.SIGKILL)
        ranks = ", ".join(map(str, sorted(pending)))
        self._stop(f"rank(s) {ranks} did not stop within {self.interrupt_grace:g}s")
        msg = (
            f"rank(s) {ranks} did not stop within interrupt_grace={self.interrupt_grace:g}s "
            "and were killed; the gang is broken: call g.restart() for fresh ranks."
        )
        if why == "timeout":
            raise DistributedTimeoutError(
                f"the execution did not finish within timeout={limit:g}s; {msg}{self._where()}",
                rank=min(pending),
                where=() if guard is None else guard.places,
            )
        if why in ("hang", "silent"):
            raise self._hung(f"\n{msg}")
        raise KeyboardInterrupt(msg)

    def _drain(self, handle: RunHandle[None], replies: dict[int, protocol.Reply]) -> None:
        """Wait (briefly) until what each rank printed has reached the caller's output."""
        until = time.monotonic() + DRAIN_S
        for r, reply in replies.items():
            want = reply.out_bytes + self._extra.get(r, 0)
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
            self._extra[r] = max(self._extra.get(r, 0), size - reply.out_bytes)

    def _outcome(
        self,
        replies: dict[int, protocol.Reply],
        what: str,
        stopped: str | None,
        limit: float | None,
    ) -> PerRank:
        __tracebackhide__ = True
        values = PerRank([None] * len(self._socks))
        failed: dict[int, ErrorRecord] = {}
        for r in sorted(replies):
            reply = replies[r]
            if isinstance(reply, protocol.Err):
                failed[r] = reply.record
                continue
            try:
                values[r] = None if reply.value is None else pickle.loads(reply.value)
            except Exception as exc:
                failed[r] = ErrorRecord(
                    rank=r,
                    exc_type=type(exc).__name__,
                    message=f"rank {r}'s value cannot be loaded here: {exc}",
                    traceback=f"{type(exc).__name__}: {exc}\n",
                    time=time.time(),
                )
        if stopped == "interrupt":
            raise KeyboardInterrupt(f"{what} was interrupted on every rank; the gang is usable.")
        if stopped == "timeout":
            raise DistributedTimeoutError(
                f"{what} did not finish within timeout={limit:g}s; every rank was interrupted "
                f"and the gang is still usable.{self._where()}",
                where=() if self._guard is None else self._guard.places,
            )
        if stopped == "hang":
            raise self._hung("\nThe gang is still usable.")
        if failed:
            run_id = None if self._handle is None else self._handle.run_id
            raise failure(failed, values, what, run_id, self._nodes_elsewhere())
        return values

    def _where(self) -> str:
        places = () if self._guard is None else self._guard.places
        return "\nWhere each rank was:\n" + where_section(places) if places else ""

    def _hung(self, more: str) -> DistributedHangError:
        err = self._hang_error
        assert err is not None
        return DistributedHangError(
            f"{err}{more}", rank=err.rank, run_id=err.run_id, ranks=err.ranks, stacks=err.stacks,
            hang=err.hang,
        )  # fmt: skip

    _hang_error: DistributedHangError | None = None
    _guard: HangGuard | None = None


__all__ = ["Exchanges", "POLL_S", "DRAIN_S"]
