"""The fork server behind the `Spawner` protocol (cf. CPython's
``popen_forkserver``: a fork server hidden behind an ordinary per-process handle)."""

from __future__ import annotations

import logging
import os
import pickle
import signal
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ...host.system import signal_tree, wait_gone
from ...wire.exitcodes import signal_name
from .. import GangSpec, LostRank, RankIO, RankProcess, RankSpec
from ..spawn import close_fds, close_write_ends
from . import protocol as p
from .client import ForkServer, ForkServerError, Signature, registry, startup_signature

if TYPE_CHECKING:
    from ...options import ForkServerOptions

_BROKEN = (OSError, ForkServerError, EOFError, pickle.PickleError)
log = logging.getLogger("gangrun.launch.forkserver")


RESTART_HINT = (
    'The next call starts a new fork server; start_method="spawn" starts ranks as fresh '
    "interpreters instead."
)


def server_death(server: ForkServer | None) -> LostRank:
    """The rank was lost with its fork server: ``"the fork server (pid N) died (killed by
    SIGKILL)"``, no rank to blame (``lifecycle.rootcause.rank_failure`` reads it)."""
    if server is None:
        return LostRank("the fork server died", hint=RESTART_HINT)
    try:
        code = server.proc.wait(2.0)
    except Exception:  # still exiting: its channel is closed, which is all we know
        code = None
    how = ""
    if code is not None:
        sig = signal_name(code)
        how = f" (killed by {sig})" if sig else f" (exit code {code})"
    return LostRank(f"the fork server (pid {server.pid}) died{how}", hint=RESTART_HINT)


class ForkedProcess:
    """A rank forked by the server: its exit code arrives on a status pipe."""

    def __init__(self, rank: int, pid: int, status_r: int, server: ForkServer | None = None):
        self.rank = rank
        self.pid = pid
        self._status_r = status_r
        self._server = server
        self.lost: LostRank | None = None  # set when the server died with this rank running
        self.node: str | None = None  # forked on this node
        # Never waited for (Ctrl-C between the fork and the gang keeping this handle): the
        # status pipe's read end is closed when the handle goes, not leaked.
        self._unwaited = weakref.finalize(self, close_fds, (status_r,))

    def discard(self) -> None:
        """The start failed: close the status pipe now (the handle will not be waited for)."""
        self._unwaited()

    def wait(self) -> int:
        data = b""
        self._unwaited.detach()  # from here on wait() owns (and closes) the descriptor
        fd, self._status_r = self._status_r, -1
        try:
            while len(data) < p.STATUS.size:
                try:
                    chunk = os.read(fd, p.STATUS.size - len(data))
                except InterruptedError:
                    continue
                if not chunk:
                    break
                data += chunk
        except OSError:
            data = b""  # treated as the server's death below
        finally:
            os.close(fd)
        if len(data) == p.STATUS.size:
            return int(p.STATUS.unpack(data)[0])
        # The server died with this rank running: the rank kills its own tree when it sees
        # that (liveness pipe); make sure it is gone and report it as killed.
        signal_tree([self.pid], signal.SIGKILL)
        wait_gone(self.pid, 5.0)
        self.lost = server_death(self._server)
        log.info("%s while rank %d (pid %d) was running", self.lost.why, self.rank, self.pid)
        return -signal.SIGKILL

    def signal(self, sig: int) -> None:
        signal_tree([self.pid], sig)


class ForkServerSpawner:
    name = "forkserver"
    lost_nodes: frozenset[str] = frozenset()  # one node

    def nodes_elsewhere(self) -> dict[int, str]:
        return {}

    def __init__(
        self,
        server: ForkServer,
        env_sig: Signature,
        pool: int,
        settings: ForkServerOptions | None = None,
    ) -> None:
        self.server: ForkServer | None = server
        self._env_sig = env_sig
        self._pool = pool
        self._settings = settings

    @classmethod
    def lease(cls, spec: GangSpec) -> ForkServerSpawner:
        """A spawner holding a lease on the server for this gang's start-up signature."""
        env_sig = startup_signature(spec.ranks[0].env) if spec.ranks else ()
        pool = len(spec.ranks)
        return cls(registry.lease(env_sig, pool, spec.forkserver), env_sig, pool, spec.forkserver)

    def start(self, spec: GangSpec, ranks: Sequence[tuple[RankSpec, RankIO]]) -> list[RankProcess]:
        try:
            assert self.server is not None
            try:
                return self._start_on(self.server, spec, ranks)
            except _BROKEN:
                # The server died or broke: one fresh server for this signature, once.
                registry.discard(self.server)
                self.server = None
                self.server = registry.lease(self._env_sig, self._pool, self._settings)
                return self._start_on(self.server, spec, ranks)
        finally:
            close_write_ends(ranks)

    def _start_on(
        self, server: ForkServer, spec: GangSpec, ranks: Sequence[tuple[RankSpec, RankIO]]
    ) -> list[RankProcess]:
        send: list[int] = []
        owned: list[int] = []  # status write ends: ours to close once sent
        handles: list[ForkedProcess] = []  # each owns its status read end from the start
        msgs = []
        try:
            for r, io in ranks:
                st_r, st_w = os.pipe()
                owned.append(st_w)
                handles.append(ForkedProcess(r.rank, 0, st_r, server))
                send += [io.out_w, io.err_w, io.live_r, st_w]
                msgs.append(p.ForkRank(r.rank, r.env, spec.cwd))
            pids = server.fork(msgs, send)
            if len(pids) != len(ranks):
                raise ForkServerError(f"the fork server started {len(pids)} of {len(ranks)} ranks")
            for h, pid in zip(handles, pids, strict=True):
                h.pid = pid
        except BaseException:
            for h in handles:
                h.discard()
            raise
        finally:
            close_fds(owned)
        return list(handles)

    def release(self, grace: float) -> None:
        server, self.server = self.server, None
        if server is not None:
            registry.release(server)
