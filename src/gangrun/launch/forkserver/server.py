"""The fork server process: preloads, then forks one child per rank on request.

It imports the heavy modules once (never initialising CUDA) and waits on its control socket.
For each `Fork` it hands every rank to an idle pre-forked child (or forks
one), keeps the rank's status pipe, and answers with the pids. It is the ranks' parent: it
reaps them (``SIGCHLD`` wakes its loop) and writes each exit code into that rank's status
pipe, so the caller sees an exit within a millisecond.

It is also the child subreaper of everything below it, so nothing a rank started outlives
it unseen: a descendant of a rank that ends re-parents here, and the server kills every
child that is neither a running rank nor an idle pool child each time it reaps a rank.
When the caller closes the channel (exit or death) the server exits; its children see the
server's liveness pipe close and take their trees down themselves.

A SIGTERM while ranks run is ignored: a scheduler that signals every process of the job
(SLURM) would otherwise take the ranks down with the server while they save a checkpoint
(the caller stops the server by closing the channel, never by a signal). An idle server
ends as SIGTERM would end it.
"""

from __future__ import annotations

import dataclasses
import os
import selectors
import signal
import socket
import sys
from collections.abc import Callable

from ...host import system as platform
from ..spawn import close_fds
from . import protocol as p

POOL_MAX = 16  # idle pre-forked children kept at most
_PRELOAD_ALWAYS = (  # everything a rank imports on its way: paid once here, not per rank
    "gangrun.rank.worker",
    "gangrun.rank.tracking",
    "gangrun.rank.progress",
    "gangrun.rank.memory",
    "gangrun.rank.source",
    "gangrun.wire.security",
    "gangrun.rank.boot",
    "inspect",
    "linecache",
    "gangrun.wire.serialization",
    "gangrun.rank.forkchild",
    "cloudpickle",
    "psutil",
    "faulthandler",
    "ctypes",
    "io",
    "random",
    "json",
    "traceback",
)


class Server:
    """The server's state: the control socket, the running children (pid -> status pipe)
    and a small pool of idle pre-forked children, so that a launch needs no fork."""

    def __init__(self, sock: socket.socket, gangrun_parent: str) -> None:
        self.sock = sock
        self.gangrun_parent = gangrun_parent
        self.status: dict[int, int] = {}  # running child pid -> write end of its status pipe
        self.pool: list[tuple[int, socket.socket]] = []  # idle children: pid, assignment socket
        self.pool_target = 0
        self.preloaded: list[str] = []
        self.failed: dict[str, str] = {}
        # Read end inherited by every child: EOF tells the child the server is gone.
        self.alive_r, self.alive_w = os.pipe()
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)

    # -- start-up ---------------------------------------------------------------------
    def init(self) -> None:
        msg, _ = p.recv(self.sock)
        if not isinstance(msg, p.Init):
            os._exit(0)
        paths = list(msg.sys_path)
        if self.gangrun_parent not in paths:
            paths.append(self.gangrun_parent)
        sys.path[:] = paths
        self.pool_target = msg.pool
        import importlib

        for name in [*msg.preload, *_PRELOAD_ALWAYS]:
            try:
                importlib.import_module(name)
                self.preloaded.append(name)
            except BaseException as exc:  # a broken optional module must not kill the server
                self.failed[name] = f"{type(exc).__name__}: {exc}"
        import gc

        gc.collect()
        gc.freeze()  # keep the preloaded objects' pages shared with the children
        p.send(self.sock, p.Ready(self.info()))

    def info(self) -> p.ServerInfo:
        torch = sys.modules.get("torch")
        cuda_init = None
        if torch is not None:
            try:
                cuda_init = bool(torch.cuda.is_initialized())
            except Exception:  # a torch without CUDA bits: unknown, reported as None
                cuda_init = None
        return p.ServerInfo(
            pid=os.getpid(),
            preloaded=list(self.preloaded),
            failed=dict(self.failed),
            cuda_initialized=cuda_init,
            threads=len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self") else 0,
            children=sorted(self.status),
            pool=[pid for pid, _ in self.pool],
        )

    # -- loop -------------------------------------------------------------------------
    def _on_sigterm(self, signum: int, frame: object) -> None:
        if self.status:  # ranks run (and may be checkpointing): they report to us
            return
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    def loop(self) -> None:
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGTERM, self._on_sigterm)
        signal.set_wakeup_fd(self.wake_w, warn_on_full_buffer=False)
        sel = selectors.PollSelector()  # no epoll fd to leak into children
        sel.register(self.sock, selectors.EVENT_READ, "ctl")
        sel.register(self.wake_r, selectors.EVENT_READ, "chld")
        while True:
            # Refill the pool only while no rank runs: forking costs CPU the ranks want.
            timeout = 0.0 if (not self.status and len(self.pool) < self.pool_target) else None
            events = sel.select(timeout)
            for key, _ in events:
                if key.data == "chld":
                    self._drain_wake()
                    continue
                try:
                    msg, fds = p.recv(self.sock, 253)
                except OSError:
                    msg, fds = None, []
                if msg is None:
                    # The caller closed the channel (exit or death). Children notice that we
                    # are gone (alive pipe / pool socket) and take their trees down themselves.
                    os._exit(0)
                self.handle(msg, fds)
            self.reap()
            if not events and not self.status and len(self.pool) < self.pool_target:
                try:
                    self.pool.append(self._fork_idle())
                except OSError:
                    self.pool_target = len(self.pool)  # out of processes: stop trying

    def _drain_wake(self) -> None:
        try:
            while os.read(self.wake_r, 4096):
                continue
        except (BlockingIOError, InterruptedError):
            return  # drained

    def reap(self) -> None:
        reaped_rank = False
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            except InterruptedError:
                continue
            if pid == 0:
                break
            fd = self.status.pop(pid, None)
            if fd is None:
                for i, (ppid, psock) in enumerate(self.pool):
                    if ppid == pid:  # an idle child died (killed from outside)
                        psock.close()
                        del self.pool[i]
                        break
                continue  # else an orphan we killed: reaped, nothing to report
            reaped_rank = True
            try:
                os.write(fd, p.STATUS.pack(os.waitstatus_to_exitcode(status)))
            except OSError:
                pass  # the caller is gone: nobody to tell
            os.close(fd)
        if reaped_rank:
            # Descendants of the ranks that ended re-parented to us (we are their subreaper):
            # nothing of a rank outlives it. Running ranks' own orphans stay with those ranks
            # (each rank is a subreaper too), so every other child here is a leftover.
            platform.kill_children(keep=set(self.status) | {pid for pid, _ in self.pool})

    def handle(self, msg: object, fds: list[int]) -> None:
        seq = msg.seq if isinstance(msg, p.Fork | p.Info) else 0  # the reply echoes it
        if isinstance(msg, p.Fork):
            try:
                pids = self.fork(msg.ranks, fds)
            except Exception as exc:
                p.send(self.sock, p.Failed(f"{type(exc).__name__}: {exc}", seq))
                return
            p.send(self.sock, p.Forked(pids, seq))
        elif isinstance(msg, p.Info):
            p.send(self.sock, dataclasses.replace(self.info(), seq=seq))
        else:
            close_fds(fds)
            p.send(self.sock, p.Failed(f"unknown request {type(msg).__name__}", seq))

    def fork(self, ranks: list[p.ForkRank], fds: list[int]) -> list[int]:
        """Start one child per rank (idle pool first); all or nothing. Consumes ``fds``."""
        n = p.FDS_PER_RANK
        pids: list[int] = []
        self.pool_target = max(self.pool_target, min(len(ranks), POOL_MAX))
        try:
            if len(fds) != n * len(ranks):
                raise ValueError(f"expected {n * len(ranks)} fds, got {len(fds)}")
            for i, r in enumerate(ranks):
                mine = fds[n * i : n * (i + 1)]
                pid = self._assign_idle(r, mine)
                if pid is None:
                    pid = self._fork_rank(r, mine, fds)
                pids.append(pid)
        except BaseException:
            for pid in pids:  # a half-started gang is of no use
                try:
                    os.killpg(pid, signal.SIGKILL)
                except OSError:
                    pass  # already gone
            close_fds(fds[n * len(pids) :])
            raise
        return pids

    def _took(self, pid: int, mine: list[int]) -> int:
        out_w, err_w, live_r, status_w = mine
        self.status[pid] = status_w
        close_fds([out_w, err_w, live_r])
        return pid

    def _assign_idle(self, r: p.ForkRank, mine: list[int]) -> int | None:
        while self.pool:
            pid, psock = self.pool.pop(0)
            try:
                p.send(psock, p.Assign(r), mine[:3])
            except OSError:  # it died meanwhile; reap() collects it
                continue
            finally:
                psock.close()
            return self._took(pid, mine)
        return None

    def _fork_rank(self, r: p.ForkRank, mine: list[int], fds: list[int]) -> int:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child never returns
            self._child(lambda: self._leave_server(keep=mine[:3], close=fds), r, mine[:3])
        return self._took(pid, mine)

    def _fork_idle(self) -> tuple[int, socket.socket]:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child never returns

            def wait_for_work() -> tuple[p.ForkRank, list[int]]:
                mine.close()
                self._leave_server(keep=[theirs.fileno()], close=[])
                theirs.setblocking(True)
                msg, fds = p.recv(theirs, 3)
                theirs.close()
                if not isinstance(msg, p.Assign) or len(fds) != 3:
                    os._exit(0)  # the server is gone, or it gave up on us
                return msg.rank, fds

            self._child(wait_for_work, None, None)
        theirs.close()
        return pid, mine

    # -- in the child -----------------------------------------------------------------
    def _child(
        self,
        prepare: Callable[[], tuple[p.ForkRank, list[int]] | None],
        r: p.ForkRank | None,
        fds: list[int] | None,
    ) -> None:
        code = 70
        try:
            got = prepare()
            if got is not None:
                r, fds = got
            assert r is not None and fds is not None
            from ...rank.forkchild import become_rank

            become_rank(r, fds, self.alive_r)  # ends with os._exit
        except BaseException:
            try:
                import traceback

                traceback.print_exc()
                sys.stderr.flush()
            except BaseException:
                pass  # nowhere left to report to
        finally:
            os._exit(code)

    def _leave_server(self, keep: list[int], close: list[int]) -> None:
        """Right after the fork: own session, default signals, none of the server's fds."""
        os.setsid()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        fds = [self.sock.fileno(), self.alive_w, self.wake_r, self.wake_w]
        fds += list(self.status.values()) + [s.fileno() for _, s in self.pool] + list(close)
        close_fds([fd for fd in fds if fd not in keep])
        self.sock.detach()
        for _, s in self.pool:
            s.detach()
        self.pool = []
        self.status = {}


def serve(fd: int, gangrun_parent: str) -> None:
    """Entry point of the fork server process."""
    sock = socket.socket(fileno=fd)
    sock.setblocking(True)
    platform.become_subreaper()
    server = Server(sock, gangrun_parent)
    server.init()
    server.loop()
