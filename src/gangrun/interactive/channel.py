"""The notebook-to-rank channel of a `Gang`: where ranks connect back.

On one node an AF_UNIX socket in a private (0700) directory; on a Ray cluster a TCP socket
on this machine's address as the cluster sees it (``ray.util.get_node_ip_address()``, or
``GANGRUN_GANG_HOST``), so ranks on any node reach it. Either way a rank proves it knows the
gang's random token before the caller reads anything else from it (`protocol.Hello`), and the
caller answers (`protocol.WELCOME`). A rank that cannot reach the caller says so within
seconds (`protocol.CallerUnreachable`), and `Gang(...)` raises `unreachable`'s error: the
channel is not routed through Ray, so a caller the nodes cannot reach (a laptop behind NAT
using Ray Client) is told to run where they can, instead of waiting for ranks that never
connect.
"""

from __future__ import annotations

import hmac
import logging
import os
import queue
import shutil
import socket
import tempfile
import threading
import time
from typing import TYPE_CHECKING, Any

from ..errors import DistributedError, DistributedTimeoutError, LaunchError
from ..rank import interactive_protocol as protocol
from ..wire import contract
from .outcome import wrapped

if TYPE_CHECKING:
    from ..api import RunHandle

log = logging.getLogger("gangrun.interactive")
POLL_S = 0.25


def release(socks: dict[int, socket.socket], path: str) -> None:
    """Close the ranks' connections (a rank that sees EOF ends its call) and the socket dir."""
    for s in socks.values():
        try:
            s.close()
        except OSError:
            log.debug("closing a gang socket failed", exc_info=True)
    socks.clear()
    if path:
        shutil.rmtree(path, ignore_errors=True)


def unreachable(err: DistributedError, address: str) -> LaunchError | None:
    """The error for ranks that could not reach the caller at ``address`` (``None``: the
    ranks failed for another reason)."""
    bad = {
        r: f
        for r, f in err.failures.items()
        if (f.exc_type or "").endswith(protocol.CallerUnreachable.__name__)
    }
    if not bad:
        return None
    first = bad[min(bad)]
    where = f" on {first.node}" if first.node else ""
    why = (first.message.splitlines() or [""])[0]  # not the note on the node's files
    ranks = ", ".join(map(str, sorted(bad)))
    return LaunchError(
        f"the gang's ranks cannot reach this caller at {address} (rank{'s' if len(bad) > 1 else ''}"
        f" {ranks}; rank {first.rank}{where}: {why}). A gang's ranks connect back "
        "to the caller over TCP, so the caller must be reachable from every node; a machine "
        "behind NAT or a firewall (a laptop connected with address='ray://head:10001') is not. "
        "Run the notebook where the nodes reach it (on the head node, or a Jupyter server in "
        "the cluster's network); or, if the nodes reach this machine under another address (a "
        f"VPN, another interface), set {contract.GANG_HOST} to it. .distributed() calls need "
        "no connection back and work from here. The gang's ranks were stopped.",
        rank=first.rank,
        exc_type=first.exc_type,
        run_id=err.run_id,
        failures=err.failures,
    )


class Listener:
    """Where the ranks of one start of a gang connect; ``address`` is what they are given.
    ``tcp``: ``(bind, advertised)`` hosts on a Ray cluster; ``None``: AF_UNIX.

    From the moment it is made a thread answers every rank that presents ``token`` (its
    `protocol.WELCOME`), however long the launch takes before `accept` runs: a rank's wait
    for that answer is bounded (`protocol.handshake`), the launch (placement, a slow
    tracking store) is not."""

    def __init__(self, tcp: tuple[str, str] | None, token: str) -> None:
        self.dir = ""
        if tcp is None:
            self.dir = tempfile.mkdtemp(prefix="gangrun-gang-")
            os.chmod(self.dir, 0o700)
            path = os.path.join(self.dir, "s")
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.bind(path)
            self.address = path
        else:
            bind, advertised = tcp
            family = socket.AF_INET6 if ":" in bind else socket.AF_INET
            self.sock = socket.socket(family, socket.SOCK_STREAM)
            self.sock.bind((bind, 0))
            self.address = f"tcp://{advertised}:{self.sock.getsockname()[1]}"
        self.sock.listen(64)
        self.sock.settimeout(POLL_S)
        self._token = token.encode("ascii")
        self._welcomed: queue.Queue[tuple[protocol.Hello, socket.socket]] = queue.Queue()
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="gangrun-gang-accept", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        """Accept, check the token, answer, hand the connection to `accept`."""
        while not self._closing.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:  # closed
                return
            conn.settimeout(10.0)
            try:
                head = protocol.recv_exact(conn, protocol.Hello.WIRE.size)
            except OSError:
                head = None
            hello = None if head is None else protocol.Hello.unpack(head)
            if hello is None or not hmac.compare_digest(hello.token, self._token):
                if hello is not None:
                    log.warning("gang: refused a connection that did not present the gang's token")
                conn.close()
                continue
            try:
                conn.sendall(protocol.WELCOME)
            except OSError:  # the rank gave up waiting: it reports that itself
                conn.close()
                continue
            self._welcomed.put((hello, conn))

    def close(self) -> None:
        self._closing.set()
        self.sock.close()
        self._thread.join(15.0)
        while True:  # connections welcomed but not taken (a failed start)
            try:
                _, conn = self._welcomed.get_nowait()
            except queue.Empty:
                break
            conn.close()

    def accept(
        self, handle: RunHandle[Any], start_timeout: float
    ) -> tuple[dict[int, socket.socket], dict[int, int]]:
        """Every rank's authenticated connection and pid (raises if the ranks end first or
        do not all connect within ``start_timeout``)."""
        n = handle.world_size
        socks: dict[int, socket.socket] = {}
        pids: dict[int, int] = {}
        deadline = time.monotonic() + start_timeout
        try:
            while len(socks) < n:
                if handle.done():
                    try:
                        handle.result(timeout=0)
                    except DistributedError as err:
                        cant = unreachable(err, self.address)
                        if cant is not None:
                            raise cant from err
                        raise wrapped(f"the gang's ranks ended while starting: {err}", err) from err
                    raise DistributedError("the gang's ranks ended while starting.")
                if time.monotonic() > deadline:
                    raise DistributedTimeoutError(
                        f"only {len(socks)} of {n} ranks of the gang started within "
                        f"start_timeout={start_timeout:g}s; the gang was stopped."
                    )
                try:
                    hello, conn = self._welcomed.get(timeout=POLL_S)
                except queue.Empty:
                    continue
                if not 0 <= hello.rank < n:
                    log.warning("gang: refused a connection for rank %d of %d", hello.rank, n)
                    conn.close()
                    continue
                conn.settimeout(None)
                if conn.family in (socket.AF_INET, socket.AF_INET6):
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                socks[hello.rank] = conn
                pids[hello.rank] = hello.pid
        except BaseException:
            release(socks, "")
            raise
        return socks, pids


__all__ = ["Listener", "release", "unreachable"]
