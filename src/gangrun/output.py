"""Live output of every rank into the caller's ``sys.stdout``/``sys.stderr``.

One pump thread per run multiplexes every rank's stdout and stderr pipes with a selector.
Complete lines are written prefixed ``[rank N] ``, batched per read. Carriage-return updates
(tqdm) are shown as one updating line: only the newest frame of each read is written, as
``\\r[rank N] frame``, so a notebook cell keeps one line per bar, not thousands. A partial line
without a carriage return is held until its newline arrives, or shown after a short idle
time (``print(..., end="")``) or once it is longer than ``LINE_CAP``; an open line that grows is
appended to, never rewritten, so what reaches the caller stays within a small factor of what
the ranks wrote, whatever the line length (a line cut by another rank's output is redrawn whole
only when short, else continued after a ``[rank N]+`` prefix). Every byte a rank writes also
goes, unchanged, to its log file.

Two more things keep the live output readable (the log files keep every byte):

- A rank's traceback that only echoes a peer's death (gloo's "Connection closed by peer"...)
  is folded into one line marked as a consequence (`gangrun.output_fold`), so the failing
  rank's own traceback stands out.
- While more than one call streams to the same place (the same stream object, or the same
  open file or terminal), each line is prefixed with the call's name (``[train rank 0]``),
  from the moment a second call starts until the call ends; a call alone keeps ``[rank N]``.
"""

from __future__ import annotations

import codecs
import logging
import os
import re
import selectors
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any

from .output_fold import HOLD_S, Fold

logger = logging.getLogger("gangrun.output")

_SPLIT = re.compile(r"(\r\n|\n|\r)")
IDLE_FLUSH_S = 0.2
READ_SIZE = 1 << 16
LINE_CAP = 1 << 16  # a partial line longer than this is shown without waiting for the idle time
REDRAW_MAX = 1 << 13  # a cut line longer than this is continued, not redrawn whole


@dataclass(eq=False)  # compared by identity (target ownership)
class _Stream:
    rank: int
    fd: int
    target: Any  # TextIO or None (not forwarded)
    log: IO[bytes]
    prefix: str
    decoder: Any = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))
    pending: list[str] = field(default_factory=list)  # current line, not yet written
    npending: int = 0  # characters in pending
    written: int = 0  # characters of the current line already written to the target
    head: str | None = ""  # those characters while at most REDRAW_MAX, else None
    cr_line: bool = False  # the current line is being redrawn with \r
    since: float = 0.0  # when the current line began (the idle timer's start)
    received: int = 0  # characters this stream sent to the target in all
    redrawn: int = 0  # characters written a second time (redraws of cut lines)
    log_failed: bool = False  # a log write failed (reported once)
    bol: bool = True  # the text fed so far ends a line (a traceback starts at a line's start)
    fold: Fold = field(default_factory=Fold)  # a traceback held back (`gangrun.output_fold`)


class _Target:
    """Shared state of one caller stream: who owns the open (unterminated) line."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream
        self.owner: _Stream | None = None
        self.failed = False  # a write failed (reported once)


def _place(stream: IO[str]) -> object:
    """Where a stream's text ends up: the open file or terminal behind it (stdout and stderr
    on one terminal are one place), else the stream object itself."""
    try:
        st = os.fstat(stream.fileno())
    except Exception:  # no file descriptor (a notebook cell's stream, a StringIO)
        return ("object", id(stream))
    return ("file", st.st_dev, st.st_ino, st.st_rdev)


def _short(qualname: str) -> str:
    """A function's name as a prefix shows it: ``train`` for ``main.<locals>.train``."""
    return qualname.rsplit("<locals>.", 1)[-1] or "call"


_sharing_lock = threading.Lock()
_streaming: weakref.WeakSet[OutputPump] = weakref.WeakSet()  # started and not yet closed


class OutputPump:
    """Forward rank output to the caller and to per-rank log files until every pipe closes."""

    def __init__(
        self,
        stdout: IO[str],
        stderr: IO[str],
        mode: str = "all",
        on_line: Callable[[int, str], None] | None = None,
        name: str = "",
        run_id: str = "",
    ) -> None:
        self._on_line = on_line  # on_line(rank, text): the newest line of each read (a panel)
        self.name = name  # the call's, for the prefix while another call shares the place
        self.run_id = run_id  # the call's id: two calls of one function are told apart by it
        self._named = ""  # the name in the prefixes ("": plain [rank N])
        self._places = {_place(stdout), _place(stderr)}
        self._targets = {"out": _Target(stdout), "err": _Target(stderr)}
        self._mode = mode
        self._sel = selectors.DefaultSelector()
        self._streams: dict[int, _Stream] = {}
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._stop_at: float | None = None
        self._thread = threading.Thread(target=self._loop, name="gangrun-output", daemon=True)
        self._started = False
        self.lines = 0

    # -- setup -------------------------------------------------------------------------
    def add(self, rank: int, kind: str, fd: int, log: IO[bytes]) -> None:
        forward = self._mode == "all" or (self._mode == "rank0" and rank == 0)
        target = self._targets[kind] if forward else None
        os.set_blocking(fd, False)
        if not self._streams:  # the first pipe, before any rank starts: it streams from now
            self._share()
        s = _Stream(rank, fd, target, log, self._prefix(rank))
        with self._lock:
            self._streams[fd] = s
            self._sel.register(fd, selectors.EVENT_READ, s)
        self._poke()

    def start(self) -> None:
        if not self._started:
            self._started = True
            self._thread.start()

    # -- calls streaming to the same place ----------------------------------------------
    def _prefix(self, rank: int) -> str:
        return f"[{self._named} rank {rank}] " if self._named else f"[rank {rank}] "

    def _share(self) -> None:
        """Join the pumps streaming now; name the calls in the prefixes of every pump that
        shares a place with another (a call's name stays in its prefixes until it ends)."""
        with _sharing_lock:
            _streaming.add(self)
            pumps = list(_streaming)
            for p in pumps:
                peers = [q for q in pumps if q is not p and q._places & p._places]
                if peers and not p._named:
                    p._set_named(_short(p.name), [_short(q.name) for q in peers])

    def _set_named(self, name: str, others: list[str]) -> None:
        """Prefix the call's lines with its name; with the start of its id when another call
        sharing the place runs the same function (``[train 3f2a9c rank 0]``)."""
        if name in others or name == "call":
            name = f"{name} {self.run_id[:6] or format(id(self) & 0xFFFFFF, '06x')}"
        self._named = name
        with self._lock:
            for s in self._streams.values():
                s.prefix = self._prefix(s.rank)

    def _unshare(self) -> None:
        with _sharing_lock:
            _streaming.discard(self)

    def _poke(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass  # the wake pipe is full (a wake-up is pending anyway) or closed at shutdown

    # -- shutdown ----------------------------------------------------------------------
    def close(self, drain_timeout: float = 5.0) -> None:
        """Drain what the ranks wrote, then stop. Pipes still held open past
        ``drain_timeout`` (e.g. by a descendant that escaped the teardown) are abandoned."""
        self._stop_at = time.monotonic() + drain_timeout
        self._poke()
        if self._started:
            self._thread.join(drain_timeout + 2.0)
        self._cleanup()
        self._unshare()

    def _cleanup(self) -> None:
        with self._lock:
            for fd, s in list(self._streams.items()):
                self._finish(s)
                try:
                    self._sel.unregister(fd)
                except Exception:
                    pass  # the selector is already closed: nothing left to unregister from
                os.close(fd)
            self._streams.clear()
            for fd in (self._wake_r, self._wake_w):
                try:
                    os.close(fd)
                except OSError:
                    pass  # closed by an earlier close(): cleanup runs once per pump anyway
            self._wake_r = self._wake_w = -1
            try:
                self._sel.close()
            except Exception:
                pass  # closing twice: the selector holds nothing more

    # -- the loop ----------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._lock:
                if not self._streams and self._stop_at is not None:
                    return
                pending = [s for s in self._streams.values() if self._waiting(s)]
                holding = [s for s in self._streams.values() if s.fold.holding]
            timeout: float | None = None
            if pending:
                timeout = max(0.0, min(s.since for s in pending) + IDLE_FLUSH_S - time.monotonic())
            if holding:
                left = max(0.0, min(s.fold.since for s in holding) + HOLD_S - time.monotonic())
                timeout = left if timeout is None else min(timeout, left)
            if self._stop_at is not None:
                left = self._stop_at - time.monotonic()
                if left <= 0:
                    return
                timeout = left if timeout is None else min(timeout, left)
            try:
                events = self._sel.select(timeout)
            except (OSError, ValueError):
                return
            for key, _ in events:
                if key.data is None:
                    try:
                        os.read(self._wake_r, 4096)
                    except OSError:
                        pass  # already drained (non-blocking): the wake-up did its job
                    continue
                self._read(key.data)
            now = time.monotonic()
            for s in holding:
                self._release_stale(s, now)
            for s in pending:
                if now - s.since >= IDLE_FLUSH_S:
                    self._show_partial(s)

    def _read(self, s: _Stream) -> None:
        try:
            data = os.read(s.fd, READ_SIZE)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            with self._lock:
                self._finish(s)
                try:
                    self._sel.unregister(s.fd)
                except Exception:
                    pass  # not registered any more: the selector forgets closed pipes
                os.close(s.fd)
                del self._streams[s.fd]
            return
        try:
            s.log.write(data)
        except Exception as exc:  # a full disk must not stop the live output
            if not s.log_failed:
                s.log_failed = True
                logger.warning("rank %d: its log file is incomplete: %s", s.rank, _why(s, exc))
        self._feed(s, s.decoder.decode(data))

    # -- text handling -----------------------------------------------------------------
    #
    # A stream's current line is ``pending`` (received, not yet written) after ``written``
    # characters already written to the target. While the target's open line is ours
    # (``tgt.owner is s``), new text is appended as it comes: nothing already written is
    # written again, so a long line without a newline costs its own length, not its length
    # once per read. When another rank's line cut ours, the rest of ours is shown on a new
    # line: the whole line again when it is short (``head``, at most REDRAW_MAX characters,
    # and within a budget of what this rank wrote), else a ``[rank N]+ `` continuation.
    def _feed(self, s: _Stream, text: str) -> None:
        if s.target is not None and s.fold.wants(text):
            text = s.fold.feed(text, s.bol)  # a traceback held, or folded
        self._show(s, text)

    def _release_stale(self, s: _Stream, now: float) -> None:
        """A traceback held past its time (or at the stream's end): shown as it came."""
        if s.fold.stale(now):
            self._show(s, s.fold.release())

    def _show(self, s: _Stream, text: str) -> None:
        if not text:
            return
        s.bol = text[-1] == "\n"
        tgt = s.target
        if tgt is None:  # not forwarded: only count lines
            self.lines += text.count("\n")
            return
        s.received += len(text)
        out: list[str] = []
        last = ""  # the newest complete line (for on_line)
        if not s.written and tgt.owner is None and "\r" not in text:
            # the common case, plain complete lines: prefixed all at once
            nl = text.rfind("\n")
            if nl >= 0:
                body = "".join(s.pending) + text[:nl] if s.npending else text[:nl]
                self.lines += body.count("\n") + 1
                out.append(s.prefix + body.replace("\n", "\n" + s.prefix) + "\n")
                last = body[body.rfind("\n") + 1 :]
                self._new_line(s, cr=False)
                text = text[nl + 1 :]
        for piece in _SPLIT.split(text):
            if not piece:
                continue
            if piece == "\n" or piece == "\r\n":
                self.lines += 1
                if self._on_line is not None:
                    last = "".join(s.pending) or last
                out.append(self._emit(s, tgt, "\n"))
            elif piece == "\r":  # a new progress frame replaces the line (inlined _new_line)
                s.pending.clear()
                s.npending = s.written = 0
                s.head = ""
                s.cr_line = True
            else:
                if not s.npending and not s.written:
                    s.since = time.monotonic()
                s.pending.append(piece)
                s.npending += len(piece)
        frame = "".join(s.pending) if self._on_line is not None and s.cr_line else ""
        # A progress frame is drawn while no other rank's bar holds the open line: two bars
        # cannot share the one line a text stream can rewrite, so the other rank's bar is
        # shown when its line ends (or once the line is free) instead of one line per frame.
        # A plain line already on screen is kept up to date; one too long to hold back until
        # its newline is shown now.
        if s.npending and (
            s.npending > LINE_CAP or (tgt.owner in (None, s) if s.cr_line else s.written > 0)
        ):
            out.append(self._emit(s, tgt, ""))
        if out:
            self._write(tgt, "".join(out))
        if self._on_line is not None and (frame or last):
            self._on_line(s.rank, frame or last)

    @staticmethod
    def _new_line(s: _Stream, cr: bool) -> None:
        s.pending.clear()
        s.npending = s.written = 0
        s.head = ""
        s.cr_line = cr

    def _emit(self, s: _Stream, tgt: _Target, end: str) -> str:
        """The text that brings ``s``'s current line up to date on ``tgt``, then ``end``
        (a newline ends the line)."""
        text = "".join(s.pending)
        if tgt.owner is s and s.written:  # our line is open: append
            out = text
        else:
            lead = self._line_prefix(s, tgt)
            if not s.written:
                out = lead + s.prefix + text
            elif s.head is not None and s.redrawn + len(s.head) <= s.received + REDRAW_MAX:
                s.redrawn += len(s.head)
                out = lead + s.prefix + s.head + text
            else:
                out = lead + s.prefix[:-1] + "+ " + text
        if end:
            tgt.owner = None
            self._new_line(s, cr=False)
            return out + end
        tgt.owner = s
        s.pending.clear()
        s.npending = 0
        s.written += len(text)
        if s.head is not None:
            s.head = s.head + text if len(s.head) + len(text) <= REDRAW_MAX else None
        return out

    @staticmethod
    def _line_prefix(s: _Stream, tgt: _Target) -> str:
        """What to write before (re)drawing a line of ``s``: end another stream's open line,
        or return the cursor to column 0 over our own (a progress bar's previous frame)."""
        if tgt.owner is not None and tgt.owner is not s:
            tgt.owner = None
            return "\n"
        if tgt.owner is s:
            return "\r"
        return ""

    @staticmethod
    def _waiting(s: _Stream) -> bool:
        """A partial line that the idle timer should show (hidden bars wait for the line)."""
        if not s.npending or s.target is None:
            return False
        return not (s.cr_line and s.target.owner not in (None, s))

    def _show_partial(self, s: _Stream) -> None:
        if self._waiting(s) and s.target is not None:
            self._write(s.target, self._emit(s, s.target, ""))

    def _finish(self, s: _Stream) -> None:
        tail = s.decoder.decode(b"", final=True)
        if tail:
            self._feed(s, tail)
        if s.fold.holding:  # the stream ended inside a traceback: shown as it came
            self._release_stale(s, float("inf"))
        tgt = s.target
        if tgt is None:
            return
        if s.npending:
            self._write(tgt, self._emit(s, tgt, "\n"))
        elif tgt.owner is s:  # close our open line
            tgt.owner = None
            self._write(tgt, "\n")
        self._new_line(s, cr=False)

    @staticmethod
    def _write(tgt: _Target, text: str) -> None:
        try:
            tgt.stream.write(text)
            tgt.stream.flush()
        except Exception as exc:  # a closed caller stream must not stop the log files
            if not tgt.failed:
                tgt.failed = True
                logger.debug("rank output could not be shown: %r", exc)


def _why(s: _Stream, exc: BaseException) -> str:
    """Why a rank's log file could not be written: a full disk named as such."""
    from .wire.diskfull import full_message, is_full

    if not is_full(exc):
        return str(exc)
    name: object
    try:
        name = os.readlink(f"/proc/self/fd/{s.log.fileno()}")
    except (OSError, ValueError, AttributeError):
        name = getattr(s.log, "name", None)
    if not isinstance(name, str):
        return str(exc)
    return full_message("the rank's output", name, exc)
