"""Folding a rank's traceback that only echoes a peer's death (for `gangrun.output`).

When a rank dies, its peers blocked in a collective fail too, each with a traceback that ends
in gloo's "Connection closed by peer", a reset connection or a store error
(`gangrun.errors.PEER_ECHO_TEXT`, the list the root-cause choice uses). Streamed as
they come, those tracebacks bury the failing rank's own. `Fold` holds a traceback, from its
``Traceback (most recent call last):`` line at a line's start, until its exception line (the
first line after it that is not indented): a peer's death echoed is shown as that one line,
marked as a consequence; any other traceback as it came. A traceback is held at most
``HOLD_S`` seconds and ``HOLD_CAP`` characters, and is shown as it came when the stream ends
inside it. The rank's log file keeps every line either way (the pump writes it first).
"""

from __future__ import annotations

import re
import time

from .errors import PEER_ECHO_TEXT

HOLD_S = 1.0  # a traceback is held at most this long for its exception line
HOLD_CAP = 1 << 16  # ... and at most this many characters
TB_HEAD = "Traceback (most recent call last):"
_TB_AT_LINE = re.compile(r"(?:^|(?<=\n))Traceback \(most recent call last\):")
_SHOWN_MAX = 300  # the folded line shows at most this much of the exception line
_ECHO = re.compile("|".join(PEER_ECHO_TEXT), re.IGNORECASE)


def is_peer_echo(line: str) -> bool:
    """The exception line says a peer went away."""
    return bool(_ECHO.search(line))


class Fold:
    """One rank stream's traceback being held (see the module's docstring)."""

    def __init__(self) -> None:
        self.held: list[str] | None = None  # the complete lines held (None: not holding)
        self.tail = ""  # a partial line after them
        self.chars = 0
        self.since = 0.0  # when holding began

    @property
    def holding(self) -> bool:
        return self.held is not None

    def wants(self, text: str) -> bool:
        """This text must go through `feed` (holding, or a traceback may start in it)."""
        return self.held is not None or TB_HEAD in text

    def feed(self, text: str, at_line_start: bool) -> str:
        """What of ``text`` to show now (``at_line_start``: the stream's text so far ended a
        line); the rest is held."""
        out: list[str] = []
        while text:
            if self.held is None:
                m = _TB_AT_LINE.search(text)
                if m is None or (m.start() == 0 and not at_line_start):
                    out.append(text)
                    break
                out.append(text[: m.start()])
                text = text[m.start() :]
                self.held, self.tail, self.chars = [], "", 0
                self.since = time.monotonic()
            nl = text.find("\n")
            if nl < 0:
                self.tail += text
                self.chars += len(text)
                text = ""
            else:
                line = self.tail + text[:nl]
                self.tail = ""
                self.chars += nl + 1
                text = text[nl + 1 :]
                self.held.append(line)
                if len(self.held) > 1 and line and not line[0].isspace():  # the exception line
                    out.append(self._folded() if is_peer_echo(line) else self.release())
                    at_line_start = True
                    continue
            if self.chars > HOLD_CAP:
                out.append(self.release())
                at_line_start = out[-1].endswith("\n")
        return "".join(out)

    def stale(self, now: float) -> bool:
        """Held past ``HOLD_S``: to be shown as it came."""
        return self.held is not None and now - self.since >= HOLD_S

    def release(self) -> str:
        """Stop holding: the held text, as it came."""
        held, tail = self.held or [], self.tail
        self.held, self.tail, self.chars = None, "", 0
        return "".join(line + "\n" for line in held) + tail

    def _folded(self) -> str:
        """Stop holding: the traceback as one line, marked as the consequence it is."""
        held = self.held or []
        self.held, self.tail, self.chars = None, "", 0
        last = held[-1].strip()
        if len(last) > _SHOWN_MAX:
            last = last[: _SHOWN_MAX - 3] + "..."
        return (
            f"{last}  [a consequence: a peer went away; this rank's {len(held)}-line "
            "traceback is in its log file]\n"
        )


__all__ = ["Fold", "HOLD_S", "HOLD_CAP", "TB_HEAD", "is_peer_echo"]
