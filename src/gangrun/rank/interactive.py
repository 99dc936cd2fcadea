"""The rank side of an interactive gang: `gang` (the long-lived call every rank runs)
and `rank_state` (the namespace that cells and functions share on a rank).

Imports nothing heavy: a rank that only serves cells pays for nothing it does not use.
"""

from __future__ import annotations

import builtins
import dataclasses
import faulthandler
import linecache
import os
import signal
import sys
import threading
import traceback
from typing import TYPE_CHECKING, Any

from ..wire import contract
from . import interactive_protocol as protocol

if TYPE_CHECKING:
    from ..wire.records import ErrorRecord

_state: dict[str, Any] | None = None
_executing = False
_written = [0]  # bytes written through sys.stdout/sys.stderr (see protocol: out_bytes)


def rank_state() -> dict[str, Any]:
    """This rank's persistent namespace in a `gangrun.Gang`: the globals that
    ``g.execute(code)`` runs in, so functions passed to ``g.run`` share state with cells."""
    if _state is None:
        raise RuntimeError(
            "gangrun.rank_state() is only available on the ranks of a gangrun.Gang "
            "(inside g.execute(...) or g.run(fn)); a plain .distributed() call has no "
            "persistent namespace."
        )
    return _state


class _Counting:
    """A text stream that counts the bytes it forwards (so the caller can wait for them)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._enc = getattr(inner, "encoding", None) or "utf-8"
        self._errors = getattr(inner, "errors", None) or "strict"

    def write(self, s: str) -> int:
        n = self._inner.write(s)
        try:
            _written[0] += len(s.encode(self._enc, self._errors))
        except (UnicodeError, LookupError, TypeError):
            _written[0] += len(s)  # an estimate is enough: it only bounds a short wait
        return int(n) if n is not None else len(s)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _on_sigint(signum: int, frame: Any) -> None:
    # The caller interrupts only running executions; one arriving while the rank waits for
    # the next command (a race with the reply) must not break the loop.
    if _executing:
        raise KeyboardInterrupt


def _trimmed_tb(exc: BaseException) -> str:
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _error_record(rank: int, exc: BaseException) -> ErrorRecord:
    from .worker import error_record as record

    return record(rank, exc, _trimmed_tb(exc))


def _run(msg: protocol.Command, ns: dict[str, Any]) -> Any:
    if isinstance(msg, protocol.Exec):
        filename = protocol.cell_filename(msg.cell_id)
        source = msg.source
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        body, last = protocol.compile_cell(source, filename)
        exec(body, ns)
        return None if last is None else eval(last, ns)
    if isinstance(msg, protocol.Run):
        import pickle

        fn, args, kwargs = pickle.loads(msg.payload)
        return fn(*args, **kwargs)
    raise ValueError(f"unknown gang command {msg!r}")


def _guarded(msg: protocol.Command, ns: dict[str, Any]) -> tuple[bool, Any]:
    """Run one command; ``(True, value)`` or ``(False, exception)``. A SIGINT can turn into a
    KeyboardInterrupt only while ``_executing`` is set, and then always lands in here."""
    global _executing
    try:
        _executing = True
        try:
            return True, _run(msg, ns)
        finally:
            _executing = False
    except BaseException as exc:
        return False, exc


def _reply(rank: int, ok: bool, value: Any, out_bytes: int) -> protocol.Reply:
    if ok:
        from ..wire import serialization

        try:
            return protocol.Ok(None if value is None else serialization.dumps(value), out_bytes)
        except Exception as exc:
            msg = (
                f"rank {rank}: the value ({type(value).__module__}.{type(value).__qualname__}) "
                f"cannot be serialized: {type(exc).__name__}: {exc}. End the cell with a "
                "statement (e.g. `x = ...;`) or return plain data; the value stays on the rank."
            )
            rec = dataclasses.replace(_error_record(rank, TypeError(msg)), traceback=msg + "\n")
            return protocol.Err(rec, out_bytes)
    return protocol.Err(_error_record(rank, value), out_bytes)


def gang(address: str, token: str) -> None:
    """Serve a `gangrun.Gang` on this rank until the caller closes it."""
    global _state
    rank = int(os.environ.get("RANK", "0"))
    _state = {"__name__": "__main__", "__builtins__": builtins}
    sys.stdout = _Counting(sys.stdout)
    sys.stderr = _Counting(sys.stderr)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _on_sigint)
        if os.environ.get(contract.RAY_NODE_ID):  # the caller cannot read this node's files:
            faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)  # to the cell
    # the caller knows of this rank (and may interrupt it) once it answered the Hello
    sock = protocol.handshake(address, protocol.Hello(token.encode("ascii"), rank, os.getpid()))
    while True:
        msg = protocol.recv(sock)
        if msg is None or isinstance(msg, protocol.Close):
            break
        if isinstance(msg, (protocol.Ok, protocol.Err)):
            raise ValueError(f"a reply sent to a rank: {msg!r}")
        ok, value = _guarded(msg, _state)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # a closed or odd stream replaced by user code: nothing to flush
                continue
        protocol.send(sock, _reply(rank, ok, value, _written[0]))
    sock.close()
