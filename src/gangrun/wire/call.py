"""``call.json``: the node's record of a call, for ``gangrun ps / logs / stacks / stop``.

Written by the caller into its private run directory at each transition of the call
(`gangrun.lifecycle.control`, 0600, replaced atomically), read from another terminal by
`gangrun.cli.node`. `CallEntry` is the record; `write` and `read` are its only writer and
reader. `read` takes a record written by another gangrun version (a call started before an
upgrade): keys it does not know are ignored, missing ones get their defaults, a value of the
wrong type is its default.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any

# The call's states that are an end (`gangrun.lifecycle.state.State` takes its terminal states
# from here): a record in one of them is a call that ended, whether its caller lives or not.
ENDED = frozenset({"succeeded", "failed", "cancelled", "timed_out", "hung"})
MAX_BYTES = 1 << 20  # a record is a few hundred bytes: anything bigger is not one


@dataclass(frozen=True)
class CallEntry:
    """One call as its caller last described it."""

    run_id: str = ""
    function: str = ""
    world_size: int = 0
    gpus: list[int] = field(default_factory=list)
    started: float = 0.0  # wall clock
    state: str = ""  # a `State`'s value
    attempt: int = 0
    max_restarts: int = 0
    pids: dict[str, int] = field(default_factory=dict)  # rank (as a string) -> pid
    log_dir: str = ""
    run_dir: str = ""
    mlflow_run_id: str | None = None
    tracking_uri: str | None = None  # its password redacted
    experiment_id: str | None = None
    checkpoint_dir: str | None = None  # the checkpoint location the call holds (one writer)
    caller_pid: int = 0
    caller: str | None = None  # the caller's process identity: "pid:start-ticks"
    caller_kind: str = ""  # "kernel", "gangrun run" or "script"
    caller_argv: list[str] = field(default_factory=list)
    uid: int = -1
    control: bool = False  # the caller serves the control socket
    updated: float = 0.0

    @property
    def ended(self) -> bool:
        return self.state in ENDED

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> CallEntry:
        """A record from its JSON object, whichever version wrote it."""
        out: dict[str, Any] = {}
        for f in fields(cls):
            if f.name in raw and raw[f.name] is not None:
                value = _typed(f.name, raw[f.name])
                if value is not None:
                    out[f.name] = value
        return cls(**out)


_STR = {"run_id", "function", "state", "log_dir", "run_dir", "caller_kind"}
_OPT_STR = {"mlflow_run_id", "tracking_uri", "experiment_id", "checkpoint_dir", "caller"}
_INT = {"world_size", "attempt", "max_restarts", "caller_pid", "uid"}
_FLOAT = {"started", "updated"}


def _typed(name: str, value: Any) -> Any:
    """``value`` as field ``name``'s type, or None (then the field keeps its default)."""
    try:
        if name in _STR or name in _OPT_STR:
            return str(value)
        if name in _INT:
            return int(value)
        if name in _FLOAT:
            return float(value)
        if name == "control":
            return bool(value)
        if name == "gpus":
            return [int(g) for g in value]
        if name == "caller_argv":
            return [str(a) for a in value]
        if name == "pids":
            return {str(r): int(p) for r, p in dict(value).items()}
    except (TypeError, ValueError):
        return None
    return None


def write(path: str, entry: CallEntry) -> None:
    """Replace the record at ``path`` atomically (0600). Raises ``OSError``."""
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(entry.to_json())
    os.rename(tmp, path)


def read(path: str, uid: int) -> CallEntry | None:
    """The record at ``path`` when it is a file owned by ``uid`` holding a JSON object (never
    through a symlink); None otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if os.fstat(fd).st_uid != uid:
            return None
        with os.fdopen(fd, "rb", closefd=False) as f:
            raw = json.loads(f.read(MAX_BYTES))
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    return CallEntry.from_dict(raw) if isinstance(raw, dict) else None


__all__ = ["ENDED", "CallEntry", "read", "write"]
