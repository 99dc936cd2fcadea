"""The wire between a `Gang` and its ranks, and how a cell is compiled.

One message is an 8-byte big-endian length followed by a pickle (protocol 5) of one frozen
record. The socket is an AF_UNIX path on one node, ``tcp://host:port`` on a Ray cluster
(`connect`). A rank first sends its `Hello` (fixed size, checked before anything is
unpickled) and waits, a bounded time, for the caller's `WELCOME` (`handshake`): a rank that
cannot connect, or reaches something that is not its caller (a NAT box or proxy accepts any
connection), raises `CallerUnreachable` at once instead of waiting. Caller to rank: `Exec` (a cell), `Run` (cloudpickled ``(fn, args, kwargs)``),
`Close`. Rank to caller: one `Ok` (the value) or `Err` (the rank's `ErrorRecord`) per
command; ``out_bytes`` is what the rank wrote through ``sys.stdout``/``sys.stderr`` so far,
so the caller knows when its output has reached the cell.
"""

from __future__ import annotations

import ast
import pickle
import socket
import struct
from dataclasses import dataclass
from typing import Any, ClassVar

from ..wire.records import ErrorRecord

HEADER = struct.Struct("!Q")
PROTOCOL = 5
MAX_MESSAGE = 1 << 40
WELCOME = b"GRok"  # the caller's answer to a Hello with the gang's token
CONNECT_S = 10.0  # a rank's wait for the connection to its caller
WELCOME_S = 20.0  # and then for the caller's WELCOME


class CallerUnreachable(ConnectionError):
    """A rank could not reach its gang's caller: no connection, or no gangrun caller
    answered its `Hello` (the caller turns it into an error saying what to do)."""


@dataclass(frozen=True)
class Hello:
    """A rank's first bytes: the gang's token, its rank and pid (a fixed-size struct)."""

    token: bytes
    rank: int
    pid: int

    WIRE: ClassVar[struct.Struct] = struct.Struct("!32sii")

    def pack(self) -> bytes:
        return self.WIRE.pack(self.token, self.rank, self.pid)

    @classmethod
    def unpack(cls, data: bytes) -> Hello:
        token, rank, pid = cls.WIRE.unpack(data)
        return cls(token, rank, pid)


@dataclass(frozen=True)
class Exec:
    """Run a cell's ``source`` (compiled as ``<gang-cell-{cell_id}>``) in the namespace."""

    cell_id: int
    source: str


@dataclass(frozen=True)
class Run:
    """Call a function: ``payload`` is cloudpickled ``(fn, args, kwargs)``."""

    payload: bytes


@dataclass(frozen=True)
class Close:
    """Leave: the rank's call returns."""


@dataclass(frozen=True)
class Ok:
    """The command's value (pickled; ``None`` for no value)."""

    value: bytes | None
    out_bytes: int = 0


@dataclass(frozen=True)
class Err:
    """The command raised: the rank's error record."""

    record: ErrorRecord
    out_bytes: int = 0


Command = Exec | Run | Close
Reply = Ok | Err
Message = Command | Reply


def frame(msg: Message) -> bytes:
    """``msg`` as one message: length header + pickle."""
    body = pickle.dumps(msg, protocol=PROTOCOL)
    return HEADER.pack(len(body)) + body


def send(sock: socket.socket, msg: Message) -> None:
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
        sock = socket.create_connection((host, int(port)), timeout=CONNECT_S)
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(address)
    return sock


def handshake(address: str, hello: Hello, wait: float = WELCOME_S) -> socket.socket:
    """The rank's end of the channel, connected and welcomed by its caller, or
    `CallerUnreachable` (within ``CONNECT_S`` + ``wait``)."""
    try:
        sock = connect(address)
    except OSError as exc:
        raise CallerUnreachable(
            f"could not connect to the gang's caller at {address}: {exc}"
        ) from None
    try:
        sock.settimeout(wait)
        sock.sendall(hello.pack())
        answer = recv_exact(sock, len(WELCOME))
    except OSError as exc:  # a timeout too
        sock.close()
        raise CallerUnreachable(
            f"connected to {address}, but no gangrun caller answered within {wait:g}s "
            f"({type(exc).__name__}: {exc}): something else accepted the connection (a NAT "
            "gateway, a proxy, another service on that address)"
        ) from None
    if answer != WELCOME:
        sock.close()
        raise CallerUnreachable(
            f"connected to {address}, but what answered is not this gang's caller (it closed "
            "the connection, or refused the gang's token)"
        )
    sock.settimeout(None)
    return sock


def _message(body: bytes) -> Message:
    msg = pickle.loads(body)
    if not isinstance(msg, (Exec, Run, Close, Ok, Err)):
        raise ValueError(f"a {type(msg).__name__} on a gang's channel: not a gangrun peer")
    return msg


def recv(sock: socket.socket) -> Message | None:
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
    return _message(body)


class Reader:
    """Incremental decoder for a non-blocking socket: feed bytes, take whole messages."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.need: int | None = None

    def feed(self, data: bytes) -> list[Message]:
        self.buf += data
        out: list[Message] = []
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
            out.append(_message(body))


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
