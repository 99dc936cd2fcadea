"""The wire between a `Gang` and its ranks, and how a cell is compiled.

One message is an 8-byte big-endian length followed by a pickle (protocol 5) of a tuple.
The socket is an AF_UNIX path on one node, ``tcp://host:port`` on a Ray cluster
(`connect`). Caller to rank: ``("exec", cell_id, source)``, ``("run", payload)`` (cloudpickled
``(fn, args, kwargs)``), ``("close",)``. Rank to caller: first ``("hello", token, rank, pid)``,
then one ``("ok", value_bytes, out_bytes)`` or ``("err", record, out_bytes)`` per command;
``out_bytes`` is what the rank wrote through ``sys.stdout``/``sys.stderr`` so far, so the
caller knows when its output has reached the cell.
"""

from __future__ import annotations

import ast
import pickle
import socket
import struct
from typing import Any

HEADER = struct.Struct("!Q")
PROTOCOL = 5
MAX_MESSAGE = 1 << 40


def frame(msg: tuple) -> bytes:
    """``msg`` as one message: length header + pickle."""
    body = pickle.dumps(msg, protocol=PROTOCOL)
    return HEADER.pack(len(body)) + body


def send(sock: socket.socket, msg: tuple) -> None:
    sock.sendall(frame(msg))


def recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            return None
        got += k
    return bytes(buf)


def connect(address: str) -> socket.socket:
    """The rank's end: ``tcp://host:port`` or an AF_UNIX path."""
    if address.startswith("tcp://"):
        host, _, port = address[len("tcp://") :].rpartition(":")
        sock = socket.create_connection((host, int(port)), timeout=60)
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(address)
    return sock


def recv(sock: socket.socket) -> tuple | None:
    """The next message from a blocking socket; ``None`` at end of stream."""
    head = recv_exact(sock, HEADER.size)
    if head is None:
        return None
    (n,) = HEADER.unpack(head)
    if n > MAX_MESSAGE:
        raise ValueError(f"message of {n} bytes: not a gangrun peer")
    body = recv_exact(sock, n) if n else b""
    if body is None:
        return None
    return pickle.loads(body)  # type: ignore[no-any-return]


class Reader:
    """Incremental decoder for a non-blocking socket: feed bytes, take whole messages."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.need: int | None = None

    def feed(self, data: bytes) -> list[Any]:
        self.buf += data
        out: list[Any] = []
        while True:
            if self.need is None:
                if len(self.buf) < HEADER.size:
                    return out
                (self.need,) = HEADER.unpack_from(self.buf)
                if self.need > MAX_MESSAGE:
                    raise ValueError(f"message of {self.need} bytes: not a gangrun peer")
                del self.buf[: HEADER.size]
            if len(self.buf) < self.need:
                return out
            body = bytes(self.buf[: self.need])
            del self.buf[: self.need]
            self.need = None
            out.append(pickle.loads(body))


def cell_filename(cell_id: int) -> str:
    return f"<gang-cell-{cell_id}>"


def compile_cell(source: str, filename: str) -> tuple[Any, Any]:
    """Compile a cell like a notebook does: ``(body, last)`` code objects, where ``last``
    evaluates the final expression (``None`` when the cell ends in a statement).

    Raises ``SyntaxError`` (with the cell's filename and line) for code that does not compile.
    """
    tree = ast.parse(source, filename, "exec")
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        tail = tree.body.pop()
        assert isinstance(tail, ast.Expr)
        last = compile(ast.Expression(tail.value), filename, "eval")
    body = compile(tree, filename, "exec")
    return body, last
