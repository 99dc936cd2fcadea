"""The control socket's messages: one `Request` line from ``gangrun stacks/stop`` (or any
client), one `Reply` line from the caller's control thread (`gangrun.lifecycle.control`).

Each is one JSON object on one line. ``{"op": "ping"}`` answers with the call's record;
``{"op": "stacks", "timeout": S}`` with every live rank's stacks; ``{"op": "stop", "by":
WHO}`` once the call has ended, with how it ended. A client and a caller of different gangrun
versions understand each other: keys a side does not know are ignored, missing ones default.
"""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass, field
from typing import Any

PING, STACKS, STOP = "ping", "stacks", "stop"


@dataclass(frozen=True)
class Request:
    op: str
    timeout: float | None = None  # stacks: seconds to wait for the ranks' dumps
    by: str = ""  # stop: who asks (shown in the call's error)

    def to_json(self) -> str:
        msg: dict[str, Any] = {"op": self.op}
        if self.timeout is not None:
            msg["timeout"] = self.timeout
        if self.by:
            msg["by"] = self.by
        return json.dumps(msg)

    @classmethod
    def from_json(cls, line: bytes | str) -> Request | None:
        """The request on ``line``; None when it is not one (then nothing is answered)."""
        try:
            raw = json.loads(line or b"{}")
        except ValueError:
            return None
        if not isinstance(raw, dict):
            return Request(op="")
        try:
            timeout = None if raw.get("timeout") is None else float(raw["timeout"])
        except (TypeError, ValueError):
            timeout = None  # the default wait
        return cls(
            op=str(raw.get("op") or ""),
            timeout=timeout,
            by=str(raw.get("by") or ""),
        )


@dataclass(frozen=True)
class Reply:
    ok: bool
    error: str | None = None  # why not ok; for a stop, the call's error's first line
    record: dict[str, Any] | None = None  # ping: the call's record (`gangrun.wire.call`)
    stacks: dict[str, str] = field(default_factory=dict)  # rank (as a string) -> its stacks
    done: bool = False  # stop: the call has ended
    state: str = ""  # stop: the state it ended in
    mlflow_status: str | None = None
    mlflow_run_id: str | None = None

    def to_json(self) -> str:
        msg: dict[str, Any] = {"ok": self.ok}
        if self.error is not None or not self.ok:
            msg["error"] = self.error
        if self.record is not None:
            msg["record"] = self.record
        if self.stacks:
            msg["stacks"] = self.stacks
        if self.state:
            msg.update(
                done=self.done,
                state=self.state,
                mlflow_status=self.mlflow_status,
                mlflow_run_id=self.mlflow_run_id,
            )
        return json.dumps(msg)

    @classmethod
    def from_json(cls, line: bytes | str) -> Reply:
        """The reply on ``line``. Raises ``ValueError`` when it is not one (the caller closed
        the connection)."""
        raw = json.loads(line)
        if not isinstance(raw, dict):
            raise ValueError(f"not a reply: {line!r}")
        stacks = raw.get("stacks")
        record = raw.get("record")
        return cls(
            ok=bool(raw.get("ok")),
            error=None if raw.get("error") is None else str(raw["error"]),
            record=record if isinstance(record, dict) else None,
            stacks={str(r): str(s or "") for r, s in stacks.items()}
            if isinstance(stacks, dict)
            else {},
            done=bool(raw.get("done")),
            state=str(raw.get("state") or ""),
            mlflow_status=None if raw.get("mlflow_status") is None else str(raw["mlflow_status"]),
            mlflow_run_id=None if raw.get("mlflow_run_id") is None else str(raw["mlflow_run_id"]),
        )


def send(conn: socket.socket, msg: Request | Reply) -> None:
    """One message, one line. Raises ``OSError`` (the other end went away)."""
    conn.sendall(msg.to_json().encode() + b"\n")


def read_line(conn: socket.socket) -> bytes:
    """The next line from ``conn`` (``b""`` at the end). Raises ``OSError``."""
    return conn.makefile("rb").readline()


def ask(path: str, request: Request, timeout: float) -> Reply:
    """One request on the control socket at ``path``; its reply. Raises ``OSError`` (no
    caller answers there) or ``ValueError`` (it closed the connection without a reply)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(path)
        try:
            send(s, request)
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused before the request was read: the reply says why
        line = read_line(s)
    finally:
        s.close()
    return Reply.from_json(line)


__all__ = ["PING", "STACKS", "STOP", "Request", "Reply", "ask", "read_line", "send"]
