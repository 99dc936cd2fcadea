"""Live output of every rank into the caller's ``sys.stdout``/``sys.stderr``.

One pump thread per run multiplexes every rank's stdout and stderr pipes with a selector.
Complete lines are written prefixed ``[rank N] ``, batched per read. Carriage-return updates
(tqdm) are shown as one updating line: only the newest frame of each read is written, as
``\\r[rank N] frame``, so a notebook cell keeps one line per bar, not thousands. A partial line
without a carriage return is held until its newline arrives, or shown after a short idle
time (``print(..., end="")``). Every byte a rank writes also goes, unchanged, to its log file.
"""

from __future__ import annotations

import codecs
import os
import re
import selectors
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Any

_SPLIT = re.compile(r"(\r\n|\n|\r)")
IDLE_FLUSH_S = 0.2
READ_SIZE = 1 << 16


@dataclass
class _Stream:
    rank: int
    fd: int
    target: Any  # TextIO or None (not forwarded)
    log: IO[bytes]
    prefix: str
    decoder: Any = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))
    buf: str = ""  # text of the current (incomplete) line
    shown: bool = False  # buf is on screen as an open line
    cr_line: bool = False  # the current line is being redrawn with \r
    since: float = 0.0  # when buf became non-empty


class _Target:
    """Shared state of one caller stream: who owns the open (unterminated) line."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.owner: _Stream | None = None


class OutputPump:
    """Forward rank output to the caller and to per-rank log files until every pipe closes."""

    def __init__(self, stdout: Any, stderr: Any, mode: str = "all", on_line: Any = None) -> None:
        self._on_line = on_line  # on_line(rank, text): the newest line of each read (a panel)
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
        s = _Stream(rank, fd, target, log, f"[rank {rank}] ")
        with self._lock:
            self._streams[fd] = s
            self._sel.register(fd, selectors.EVENT_READ, s)
        self._poke()

    def start(self) -> None:
        if not self._started:
            self._started = True
            self._thread.start()

    def _poke(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    # -- shutdown ----------------------------------------------------------------------
    def close(self, drain_timeout: float = 5.0) -> None:
        """Drain what the ranks wrote, then stop. Pipes still held open past
        ``drain_timeout`` (e.g. by a descendant that escaped the teardown) are abandoned."""
        self._stop_at = time.monotonic() + drain_timeout
        self._poke()
        if self._started:
            self._thread.join(drain_timeout + 2.0)
        self._cleanup()

    def _cleanup(self) -> None:
        with self._lock:
            for fd, s in list(self._streams.items()):
                self._finish(s)
                try:
                    self._sel.unregister(fd)
                except Exception:
                    pass
                os.close(fd)
            self._streams.clear()
            for fd in (self._wake_r, self._wake_w):
                try:
                    os.close(fd)
                except OSError:
                    pass
            self._wake_r = self._wake_w = -1
            try:
                self._sel.close()
            except Exception:
                pass

    # -- the loop ----------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._lock:
                if not self._streams and self._stop_at is not None:
                    return
                pending = [s for s in self._streams.values() if self._waiting(s)]
            timeout: float | None = None
            if pending:
                timeout = max(0.0, min(s.since for s in pending) + IDLE_FLUSH_S - time.monotonic())
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
                        pass
                    continue
                self._read(key.data)
            now = time.monotonic()
            for s in pending:
                if s.buf and not s.shown and now - s.since >= IDLE_FLUSH_S:
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
                    pass
                os.close(s.fd)
                del self._streams[s.fd]
            return
        try:
            s.log.write(data)
        except Exception:
            pass
        self._feed(s, s.decoder.decode(data))

    # -- text handling -----------------------------------------------------------------
    def _feed(self, s: _Stream, text: str) -> None:
        out: list[str] = []
        tgt = s.target
        last = ""
        for piece in _SPLIT.split(text):
            if not piece:
                continue
            if piece == "\n" or piece == "\r\n":
                self.lines += 1
                last = s.buf or last
                if tgt is not None:
                    out.append(self._line_prefix(s, tgt) + ("" if s.shown else s.prefix + s.buf))
                    out.append("\n")
                    tgt.owner = None
                s.buf, s.shown, s.cr_line = "", False, False
            elif piece == "\r":
                s.buf, s.shown, s.cr_line = "", False, True
            else:
                if not s.buf:
                    s.since = time.monotonic()
                if s.shown and tgt is not None:
                    # the open line grows: redraw it whole
                    s.shown = False
                s.buf += piece
        # A progress frame is drawn only while no other rank's bar holds the open line: two
        # bars cannot share the one line a text stream can rewrite, so the other rank's bar is
        # shown when its line ends (or once the line is free) instead of one line per frame.
        if s.buf and s.cr_line and not s.shown and tgt is not None and tgt.owner in (None, s):
            out.append(self._open_line(s, tgt))
        if out and tgt is not None:
            self._write(tgt, "".join(out))
        if self._on_line is not None and (last or s.cr_line):
            self._on_line(s.rank, s.buf if s.cr_line and s.buf else last)

    def _line_prefix(self, s: _Stream, tgt: _Target) -> str:
        """What to write before a line of ``s``: close another stream's open line, or
        return the cursor to column 0 to redraw our own."""
        if tgt.owner is not None and tgt.owner is not s:
            other = tgt.owner
            other.shown = False
            tgt.owner = None
            return "\n"
        if tgt.owner is s and not s.shown:
            return "\r"
        return ""

    def _open_line(self, s: _Stream, tgt: _Target) -> str:
        head = self._line_prefix(s, tgt)
        if tgt.owner is s:
            head = "\r"
        tgt.owner = s
        s.shown = True
        return head + s.prefix + s.buf

    @staticmethod
    def _waiting(s: _Stream) -> bool:
        """A partial line that the idle timer should show (hidden bars wait for the line)."""
        if not s.buf or s.shown or s.target is None:
            return False
        return not (s.cr_line and s.target.owner not in (None, s))

    def _show_partial(self, s: _Stream) -> None:
        if self._waiting(s) and s.target is not None:
            self._write(s.target, self._open_line(s, s.target))

    def _finish(self, s: _Stream) -> None:
        tail = s.decoder.decode(b"", final=True)
        if tail:
            self._feed(s, tail)
        if s.buf or s.shown:
            if s.target is not None:
                text = ("" if s.shown else self._line_prefix(s, s.target) + s.prefix + s.buf) + "\n"
                s.target.owner = None
                self._write(s.target, text)
            s.buf, s.shown = "", False

    @staticmethod
    def _write(tgt: _Target, text: str) -> None:
        try:
            tgt.stream.write(text)
            tgt.stream.flush()
        except Exception:
            pass
