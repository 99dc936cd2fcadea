"""The fork server's wire protocol: typed messages over a unix ``SOCK_SEQPACKET`` pair.

One message is one pickled dataclass (at most `MSG_MAX` bytes) plus, for a fork, the
rank's pipe ends as ``SCM_RIGHTS`` ancillary data. The caller sends `Init` once, then
`Fork` / `Info` requests, each answered by one reply. An idle pre-forked child
gets its rank as `Assign` on its own socket pair.

File descriptors of a `Fork`: `FDS_PER_RANK` per rank, in rank order:
``stdout write end, stderr write end, caller liveness read end, status write end``; the server
writes the rank's exit code (`STATUS`) into the status pipe when it reaps the rank.
"""

from __future__ import annotations

import os
import pickle
import socket
import struct
from dataclasses import dataclass

MSG_MAX = 8 << 20
SOCK_BUF = 8 << 20
FDS_PER_RANK = 4
RANKS_PER_MSG = 48  # SCM_RIGHTS carries at most 253 fds per message
STATUS = struct.Struct("<i")


@dataclass(frozen=True)
class Init:
    sys_path: list[str]
    preload: list[str]
    pool: int  # idle pre-forked children to keep


@dataclass(frozen=True)
class ForkRank:
    """One rank to fork: its environment and working directory."""

    rank: int
    env: dict[str, str]
    cwd: str


@dataclass(frozen=True)
class Fork:
    """Request: fork these ranks (fds per rank: stdout, stderr, liveness, status)."""

    ranks: list[ForkRank]
    seq: int = 0  # echoed by the reply (see `Forked`)


@dataclass(frozen=True)
class Info:
    """Request: the server's `ServerInfo`."""

    seq: int = 0


@dataclass(frozen=True)
class Assign:
    rank: ForkRank  # to an idle child: become it (fds: stdout, stderr, liveness read end)


@dataclass(frozen=True)
class ServerInfo:
    pid: int
    preloaded: list[str]
    failed: dict[str, str]
    cuda_initialized: bool | None
    threads: int
    children: list[int]
    pool: list[int]
    seq: int = 0


@dataclass(frozen=True)
class Forked:
    pids: list[int]  # in the order of the request's ranks
    # Every reply echoes its request's ``seq``: a caller interrupted (Ctrl-C) between its
    # send and its receive, or just after the receive, never takes a late reply for the
    # answer to a later request, nor waits for one it already consumed.
    seq: int = 0


@dataclass(frozen=True)
class Failed:
    """A request could not be served; nothing of it was started."""

    error: str
    seq: int = 0


@dataclass(frozen=True)
class Ready:
    """The answer to `Init`: preloading is done."""

    info: ServerInfo


Request = Init | Fork | Info
Reply = Ready | Forked | ServerInfo | Failed


class ProtocolError(OSError):
    """A malformed or truncated message."""


def send(sock: socket.socket, msg: object, fds: list[int] | tuple[int, ...] = ()) -> None:
    data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    if len(data) > MSG_MAX:
        raise ProtocolError(f"fork server message too large ({len(data)} bytes)")
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.sendall(data)


def recv(sock: socket.socket, maxfds: int = 0) -> tuple[object | None, list[int]]:
    """One message (and the fds it carries); ``(None, [])`` at EOF."""
    if maxfds:
        data, fds, flags, _ = socket.recv_fds(sock, MSG_MAX, maxfds)
    else:
        data, fds, flags = sock.recv(MSG_MAX), [], 0
    if not data or flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
        for fd in fds:
            os.close(fd)
        if data:
            raise ProtocolError("fork server message truncated")
        return None, []
    return pickle.loads(data), list(fds)
