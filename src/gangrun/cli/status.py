"""``gangrun run`` on a terminal: one status line with the call's progress, under the output.

``step 120/1000 (12%) · 3.2 steps/s · ETA 4m35s · slow: rank 1 (0.45x)`` is redrawn in place
on stderr (``\\r`` + erase line) about once a second, only while stderr is a terminal and
only once a rank reports its steps (`gangrun.report_step`): nothing is guessed, and
nothing is written into a pipe or a file. Rank output goes through `ClearingStream`,
which erases the status line before each write, so a ``[rank N]`` line never lands after it.
"""

from __future__ import annotations

import threading
from typing import IO, TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..api import RunHandle

CLEAR = "\r\x1b[K"
REFRESH_S = 1.0


class StatusLine:
    """The status line of one call, drawn on ``tty``."""

    def __init__(self, tty: IO[str]) -> None:
        self.tty = tty
        self.lock = threading.Lock()
        self.shown = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def clear(self) -> None:
        """Erase the line (call with `lock` held)."""
        if self.shown:
            self.tty.write(CLEAR)
            self.shown = ""

    def draw(self, text: str) -> None:
        with self.lock:
            if text == self.shown:
                return
            self.tty.write(CLEAR + text[: _columns(self.tty) - 1])
            self.tty.flush()
            self.shown = text

    def follow(self, handle: RunHandle[Any]) -> None:
        """Redraw from ``handle.progress()`` until `close`."""
        from ..progress_view import summary_line

        def loop() -> None:
            while not self._stop.wait(REFRESH_S):
                try:
                    line = summary_line(handle.progress())
                except Exception:  # the call is ending: nothing more to show
                    return
                if line:
                    self.draw(f"gangrun: {line}")

        self._thread = threading.Thread(target=loop, name="gangrun-status", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)
        with self.lock:
            self.clear()
            self.tty.flush()


class ClearingStream:
    """A text stream that erases the status line before it writes (rank output)."""

    def __init__(self, stream: IO[str], status: StatusLine) -> None:
        self._stream = stream
        self._status = status

    def write(self, text: str) -> int:
        with self._status.lock:
            if self._status.shown:
                self._status.clear()
                self._status.tty.flush()
            return self._stream.write(text)

    def flush(self) -> None:
        self._stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _columns(tty: IO[str]) -> int:
    import os

    try:
        return os.get_terminal_size(tty.fileno()).columns or 100
    except (OSError, ValueError, AttributeError):
        return 100


def start(
    submit: Callable[[IO[str], IO[str]], RunHandle[Any]],
    stdout: IO[str],
    stderr: IO[str],
) -> tuple[RunHandle[Any], StatusLine | None]:
    """Start the call, ``submit(out, err)``, with a status line on ``stderr`` when it is a
    terminal: the call writes to ``stdout``/``stderr`` themselves, or, under a status line,
    to streams that erase it first. Returns the handle and the status line (``None``: not a
    terminal)."""
    try:
        tty = stderr.isatty()
    except (AttributeError, ValueError):
        tty = False
    if not tty:
        return submit(stdout, stderr), None
    status = StatusLine(stderr)
    # a text stream by duck typing: write and flush its own, the rest the stream's
    out, err = (cast("IO[str]", ClearingStream(s, status)) for s in (stdout, stderr))
    handle = submit(out, err)
    status.follow(handle)
    return handle, status


__all__ = ["StatusLine", "ClearingStream", "start"]
