"""Output of a call goes to the cell that launched it.

ipykernel (>= 6.29 / 7) routes what a thread writes to ``sys.stdout``/``sys.stderr`` by the
*parent header* current in that thread: ``OutStream.parent_header`` reads a context
variable, and falls back to the header of whatever cell executes right now. The output pump
is a thread of its own, so without help a ``submit()``-ed call's lines would land in
whichever cell runs when they arrive. `cell_writer` captures the launching request's
header at submit time and names it around every write (``set_thread_parent`` /
``reset_thread_parent``), so each line keeps its cell, also after that cell finished.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

log = logging.getLogger("gangrun.notebook")


def current_parent(stream: Any) -> dict[str, Any] | None:
    """The parent header ``stream`` would use now (the executing request), if it routes."""
    if not hasattr(stream, "set_thread_parent"):
        return None
    try:
        header = stream.parent_header
    except Exception:  # not an ipykernel stream after all
        return None
    return dict(header) if header else None


@contextlib.contextmanager
def parent_of(parent: dict[str, Any] | None, *targets: Any) -> Iterator[None]:
    """Within the block, this thread's output on ``targets`` (OutStreams, the display
    publisher) belongs to ``parent``."""
    tokens = []
    if parent:
        for t in targets:
            if hasattr(t, "set_thread_parent"):
                tokens.append((t, t.set_thread_parent(parent)))
    try:
        yield
    finally:
        for t, tok in reversed(tokens):
            try:
                t.reset_thread_parent(tok)
            except (ValueError, RuntimeError):  # token of another context: nothing to undo
                log.debug("could not reset the parent header of %r", t)


class CellWriter:
    """A text stream that writes to ``stream`` on behalf of the request ``parent``."""

    def __init__(self, stream: Any, parent: dict[str, Any]) -> None:
        self.stream = stream
        self.parent = parent

    def write(self, text: str) -> int:
        with parent_of(self.parent, self.stream):
            n = self.stream.write(text)
        return len(text) if n is None else int(n)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return False

    def retarget(self) -> None:
        """From now on, write for the request executing now (a gang's next cell)."""
        self.parent = current_parent(self.stream) or self.parent

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def cell_writer(stream: Any) -> Any:
    """``stream`` bound to the request executing now; ``stream`` itself when it does not
    route by request (a terminal, a file, an older ipykernel)."""
    parent = current_parent(stream)
    return stream if parent is None else CellWriter(stream, parent)


__all__ = ["cell_writer", "current_parent", "parent_of", "CellWriter"]
