"""Typed records the caller and its ranks exchange through the run directory.

Rank-side safe: imports nothing of gangrun's caller side, so `gangrun.rank.worker` (inside a
rank) and the call's lifecycle (in the caller) share these definitions.

- `RankContext` is ``context.json``: what a rank adopts from its caller (``sys.path``,
  working directory, ``argv``) and who the caller is (process identity, host, PID namespace:
  only a run directory whose caller is provably dead on *this* host and namespace is reaped).
- `ErrorRecord` is ``error.<rank>.pkl``: how a rank ended when it did not return.
- `RankFailure` is one rank's failure as the caller reports it
  (``DistributedError.failures``).
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import asdict, dataclass, field


def pid_namespace() -> str:
    """This process's PID namespace (``pid:[4026531836]``); ``""`` when unknown."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


@dataclass(frozen=True)
class RankContext:
    """``context.json``: written once by the caller, read by every rank."""

    sys_path: list[str]
    cwd: str
    argv: list[str] = field(default_factory=list)
    caller: str | None = None  # platform.process_identity of the caller: "pid:start-ticks"
    host: str = ""
    pid_ns: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> RankContext:
        raw = json.loads(text)
        if not isinstance(raw, dict):
            raise ValueError("context.json is not an object")
        return cls(
            sys_path=[str(p) for p in raw.get("sys_path") or []],
            cwd=str(raw.get("cwd") or ""),
            argv=[str(a) for a in raw.get("argv") or []],
            caller=raw.get("caller"),
            host=str(raw.get("host") or ""),
            pid_ns=str(raw.get("pid_ns") or ""),
        )

    def same_machine(self) -> bool:
        """The caller ran on this host, in this PID namespace (its pid means something here)."""
        return self.host == socket.gethostname() and self.pid_ns == pid_namespace() != ""


@dataclass(frozen=True)
class ErrorRecord:
    """``error.<rank>.pkl``: the rank raised (or called ``sys.exit``) instead of returning."""

    rank: int
    exc_type: str
    message: str
    traceback: str
    time: float
    pid: int | None = None
    exitcode: int | None = None  # set for SystemExit: the code the rank exits with
    exc: bytes | None = None  # the pickled exception, when it can be rebuilt
    frame: str | None = None  # the innermost frame of user code: "file:line in function"

    @property
    def is_clean_exit(self) -> bool:
        """``sys.exit(0)``/``sys.exit()``: the rank ended on purpose without returning."""
        return self.exc_type == "SystemExit" and self.exitcode == 0

    @classmethod
    def coerce(cls, obj: object) -> ErrorRecord | None:
        """The `ErrorRecord` an error file held; ``None`` for anything else (every writer
        writes the record itself: the rank, and nothing else)."""
        return obj if isinstance(obj, cls) else None


def _library_dirs() -> tuple[str, ...]:
    import sysconfig

    here = os.path.dirname(os.path.abspath(__file__))  # gangrun's own frames
    dirs = {here + os.sep}
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        path = sysconfig.get_paths().get(key)
        if path:
            dirs.add(os.path.abspath(path) + os.sep)
    return tuple(sorted(dirs))


def user_frame(exc: BaseException) -> str | None:
    """The innermost frame of *user* code in ``exc``'s traceback, as ``"file:line in
    function"``: gangrun's own frames, the standard library, installed packages
    (``site-packages``/``dist-packages``) and import machinery (``<frozen ...>``) are
    skipped. ``None`` when no frame is left (the exception never passed through user code)."""
    import traceback

    libs = _library_dirs()
    try:
        frames = traceback.extract_tb(exc.__traceback__)
    except Exception:  # a traceback that cannot be walked: no frame
        return None
    for fs in reversed(frames):
        name = fs.filename or ""
        if name.startswith("<frozen") or "site-packages" in name or "dist-packages" in name:
            continue
        path = os.path.abspath(name) if not name.startswith("<") else name
        if path.startswith(libs):
            continue
        return f"{name}:{fs.lineno} in {fs.name}"
    return None


@dataclass(frozen=True)
class RankFailure:
    """One rank's failure, as ``DistributedError.failures[rank]`` reports it."""

    rank: int
    exitcode: int | None  # negative: killed by signal -exitcode
    signal: str | None  # "SIGKILL", "SIGSEGV"... when it died by a signal
    exc_type: str | None  # the exception it raised ("SystemExit" for sys.exit)
    message: str  # the exception's message, or what is known of the exit
    traceback: str | None  # the rank's formatted traceback when it raised
    time: float = 0.0  # when it failed (time.time())
    frame: str | None = None  # where in user code it raised: "file:line in function"
    # a rank on another node than the caller's (Ray): where, as errors name it
    # ("node 10.0.0.2 (Ray node id 1a2b...)"); None on the caller's node
    node: str | None = None

    @property
    def is_clean_exit(self) -> bool:
        """``sys.exit(0)`` before returning: a failure only when a peer then fails."""
        return self.exc_type == "SystemExit" and self.exitcode == 0


__all__ = ["RankContext", "ErrorRecord", "RankFailure", "pid_namespace", "user_frame"]
