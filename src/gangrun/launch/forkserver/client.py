"""The caller's side of the fork servers: a handle per server process, and the registry.

Variables that only act at interpreter start-up (``PYTHONHASHSEED``, ``LD_PRELOAD``, OpenMP
affinity, ...) cannot be changed in a forked child, so a server serves one start-up
signature (those variables' values, plus the preloaded modules). The registry keeps one
server per signature while any call uses it (a call with another signature gets its own
server and never disturbs a running one), keeps the last one warm for the
next call, and closes the other idle ones.

A server that failed to start is not tried again at once: ``auto`` calls start fresh
interpreters for a back-off (`RETRY_FIRST_S`, doubled after each further failure, at most
`RETRY_MAX_S`), then try again; one good start forgets the failures.

In a child forked from the caller the registry forgets every server (their channels are
closed there, not used): the server notices the caller's death by its channel's EOF, and a
forked child must not hold that open (the server would outlive the caller).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ...host import system as platform
from ...options import ForkServerOptions, setting
from ...rank.forkchild import pad_value
from ...wire import contract
from . import protocol as p

log = logging.getLogger("gangrun.launch.forkserver")

RETRY_FIRST_S = 10.0  # after a failed start, auto calls spawn for this long, then retry
RETRY_MAX_S = 600.0  # the back-off doubles after each further failure, up to this
BOOT = (
    "import sys; sys.path.insert(0, {path!r}); "
    "from gangrun.launch.forkserver.server import serve; serve(int(sys.argv[1]), {path!r})"
)
Signature = tuple[tuple[str, str], ...]

# Environment variables read only when an interpreter (or a native library it loads at
# import) starts: a forked child cannot change them afterwards.
_STARTUP_EXACT = frozenset(
    {"LD_PRELOAD", "LD_LIBRARY_PATH", "LD_BIND_NOW", "PYTHONHOME", "CUDA_MODULE_LOADING"}
)
_STARTUP_PREFIXES = ("PYTHON", "MALLOC_", "GOMP_", "KMP_", "OMP_", "MKL_", "TORCH_CPP_", "GLIBC_")
_RUNTIME_OK = frozenset(
    {
        "PYTHONPATH",  # the caller's sys.path is applied explicitly
        "PYTHONUNBUFFERED",
        "PYTHONIOENCODING",
        "PYTHONDONTWRITEBYTECODE",
        "PYTHONBREAKPOINT",
        "OMP_NUM_THREADS",  # applied with torch.set_num_threads
        "MKL_NUM_THREADS",
    }
)
# Not inherited by the server from the caller (the server must look like no run's process).
_SERVER_DROP = frozenset({"OMP_NUM_THREADS", "MKL_NUM_THREADS"})


def startup_var(name: str) -> bool:
    if name in _RUNTIME_OK:
        return False
    return name in _STARTUP_EXACT or name.startswith(_STARTUP_PREFIXES)


def startup_signature(env: dict[str, str]) -> Signature:
    """The start-up-only variables of ``env``: a forked rank inherits the server's."""
    return tuple(sorted((k, v) for k, v in env.items() if startup_var(k)))


def usable() -> bool:
    return (
        sys.platform.startswith("linux")
        and hasattr(os, "fork")
        and hasattr(socket, "send_fds")
        and hasattr(socket, "AF_UNIX")
    )


class ForkServerError(RuntimeError):
    pass


class ForkServer:
    """The caller's handle on one fork server process."""

    def __init__(
        self,
        preload: tuple[str, ...],
        env_sig: Signature,
        pool: int = 2,
        start_timeout: float = 300.0,
    ) -> None:
        from ..spawn import GANGRUN_PARENT

        self.preload = preload
        self.env_sig = env_sig
        self.lock = threading.Lock()
        # Each request carries the next sequence number and its reply echoes it: replies to
        # requests whose caller was interrupted (Ctrl-C between send and receive) are
        # dropped, and a reply consumed just before the interrupt is not waited for.
        self._seq = 0
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        for s in (parent, child):
            for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                try:
                    s.setsockopt(socket.SOL_SOCKET, opt, p.SOCK_BUF)
                except OSError:
                    pass  # the system's maximum applies: large gangs need several messages
        env = {contract.ENVIRON_PAD: pad_value()}
        for k, v in os.environ.items():
            if k in _SERVER_DROP or contract.ours(k) or startup_var(k):
                continue
            env[k] = v
        env.update(dict(env_sig))
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", BOOT.format(path=GANGRUN_PARENT), str(child.fileno())],
                pass_fds=(child.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                env=env,
                start_new_session=True,  # no terminal signals (Ctrl-C) for the server
            )
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()
        self.sock = parent
        try:
            p.send(parent, p.Init(list(map(os.fspath, sys.path)), list(preload), pool))
            parent.settimeout(start_timeout)
            msg, _ = p.recv(parent)
            if not isinstance(msg, p.Ready):
                raise ForkServerError(
                    f"the fork server did not start (exit code {self.proc.poll()})"
                )
            self.info = msg.info
        except BaseException:
            self.close(0.0)
            raise

    @property
    def pid(self) -> int:
        return int(self.proc.pid)

    def alive(self) -> bool:
        return self.proc.poll() is None and self.sock.fileno() != -1

    def request(self, msg: object, fds: list[int] | None = None, timeout: float = 60.0) -> object:
        with self.lock:
            self._seq += 1
            seq = self._seq
            msg = dataclasses.replace(msg, seq=seq)  # type: ignore[type-var]
            self.sock.settimeout(timeout)
            p.send(self.sock, msg, fds or ())
            while True:
                reply, extra = p.recv(self.sock)
                for fd in extra:
                    os.close(fd)
                if reply is None:
                    raise ConnectionResetError("the fork server closed its channel")
                if isinstance(reply, p.Forked | p.ServerInfo | p.Failed) and reply.seq == seq:
                    break
                log.debug("dropped the fork server's late reply %s", type(reply).__name__)
        if isinstance(reply, p.Failed):
            raise ForkServerError(reply.error)
        return reply

    def fork(self, ranks: list[p.ForkRank], fds: list[int]) -> list[int]:
        pids: list[int] = []
        n, step = p.FDS_PER_RANK, p.RANKS_PER_MSG
        for i in range(0, len(ranks), step):
            chunk = ranks[i : i + step]
            reply = self.request(p.Fork(chunk), fds[n * i : n * (i + len(chunk))])
            if not isinstance(reply, p.Forked):
                raise ForkServerError(f"unexpected reply {type(reply).__name__}")
            pids += reply.pids
        return pids

    def server_info(self) -> p.ServerInfo:
        reply = self.request(p.Info(), timeout=10.0)
        if not isinstance(reply, p.ServerInfo):
            raise ForkServerError(f"unexpected reply {type(reply).__name__}")
        return reply

    def close(self, wait: float = 2.0) -> None:
        try:
            self.sock.close()
        except OSError as exc:  # closing is all we wanted
            log.debug("closing the fork server channel: %s", exc)
        try:
            self.proc.wait(wait)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            try:
                self.proc.wait(5.0)
            except subprocess.TimeoutExpired:  # pragma: no cover - unkillable (D state)
                log.warning("fork server %d did not exit", self.pid)

    def forget(self) -> None:
        """In a forked child of the caller: drop the channel without touching the server."""
        try:
            os.close(self.sock.detach())
        except OSError:
            return  # not open here


Factory = Callable[[tuple[str, ...], Signature, int, float], ForkServer]


@dataclass
class _Entry:
    server: ForkServer
    users: int = 0


class Registry:
    """The fork servers of this process, one per start-up signature (see module doc)."""

    def __init__(
        self, factory: Factory = ForkServer, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.factory = factory
        self.clock = clock
        self.start_failure: str | None = None  # the last failed start, until one succeeds
        self.failures = 0  # failed starts in a row
        self._retry_at = 0.0
        self._servers: dict[tuple[tuple[str, ...], Signature], _Entry] = {}
        self._last: ForkServer | None = None
        self._lock = threading.Lock()
        platform.forget_in_forked_child(self)

    def retry_in(self) -> float:
        """Seconds until a server may be started again after a failed start (0: now)."""
        if self.start_failure is None:
            return 0.0
        return max(0.0, self._retry_at - self.clock())

    def lease(
        self,
        env_sig: Signature,
        pool: int = 2,
        settings: ForkServerOptions | None = None,
    ) -> ForkServer:
        """A running server for this signature and the preloaded modules of ``settings``
        (the call's ``forkserver`` option; started if needed); give it back with `release`
        when the gang is done."""
        fs = (settings or ForkServerOptions()).with_builtins()
        key = (tuple(fs.preload or ()), env_sig)
        start_timeout = float(setting(fs, "start_timeout"))
        idle: list[ForkServer] = []
        with self._lock:
            entry = self._servers.get(key)
            if entry is not None and not entry.server.alive():
                del self._servers[key]  # died (killed): its ranks died with it
                idle.append(entry.server)
                entry = None
            if entry is None:
                try:
                    entry = _Entry(self.factory(key[0], env_sig, pool, start_timeout))
                except BaseException as exc:
                    self.start_failure = f"{type(exc).__name__}: {exc}"
                    self.failures += 1
                    back_off = min(RETRY_MAX_S, RETRY_FIRST_S * 2 ** (self.failures - 1))
                    self._retry_at = self.clock() + back_off
                    raise
                self.start_failure = None
                self.failures = 0
                self._servers[key] = entry
            entry.users += 1
            self._last = entry.server
            for k, other in list(self._servers.items()):
                if k != key and other.users == 0:
                    del self._servers[k]
                    idle.append(other.server)
        for s in idle:
            s.close(0.5)
        return entry.server

    def release(self, server: ForkServer) -> None:
        with self._lock:
            for entry in self._servers.values():
                if entry.server is server:
                    entry.users = max(0, entry.users - 1)

    def discard(self, server: ForkServer) -> None:
        """A broken server: forget and stop it (its users' ranks are gone with it)."""
        with self._lock:
            for k, entry in list(self._servers.items()):
                if entry.server is server:
                    del self._servers[k]
            if self._last is server:
                self._last = None
        server.close(0.5)

    def current(self) -> ForkServer | None:
        s = self._last
        return s if s is not None and s.alive() else None

    def servers(self) -> list[ForkServer]:
        with self._lock:
            return [e.server for e in self._servers.values()]

    def close_all(self, wait: float = 2.0) -> None:
        with self._lock:
            servers = [e.server for e in self._servers.values()]
            self._servers.clear()
            self._last = None
        for s in servers:
            s.close(wait)

    def after_fork_in_child(self) -> None:
        for entry in self._servers.values():
            entry.server.forget()
        self._servers = {}
        self._last = None
        self._lock = threading.Lock()
        platform.forget_in_forked_child(self)  # and in this child's own children


registry = Registry()
