"""What the kernel lets a rank start with, checked before anything starts: a too-large
environment is a `LaunchError` naming the variable, not an ``E2BIG`` from ``execve``.

``execve`` refuses (``E2BIG``) one environment string (``NAME=value``) over ``MAX_ARG_STRLEN``
(32 pages) and a whole argument + environment block over ``ARG_MAX``. A fresh interpreter
would fail to start with a bare ``OSError``; a forked rank would start but fail on its first
``subprocess`` (and the fork server's ``/proc/PID/environ`` copy only holds the first 32 KiB
of a rank's environment anyway). Every start method applies the same check, so a call never
works with one and fails with the other.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from ..errors import LaunchError
from . import RankSpec

MAX_ARG_STRLEN = 32 * 4096  # include/uapi/linux/binfmts.h (32 pages of 4 KiB)
_ARGV_ROOM = 64 * 1024  # the interpreter's own argv and auxv, with room to spare


def _arg_max() -> int:
    try:
        return int(os.sysconf("SC_ARG_MAX"))
    except (ValueError, OSError):  # pragma: no cover - no sysconf
        return 2 * 1024 * 1024


def _size(name: str, value: str) -> int:
    return len(os.fsencode(name)) + len(os.fsencode(value)) + 2  # "=" and the NUL


def _fmt(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB" if n >= 1 << 20 else f"{n / 1024:.0f} KiB"


def check_env(ranks: Iterable[RankSpec]) -> None:
    """Raise [`LaunchError`][gangrun.errors.LaunchError] when a rank's environment cannot be exec'ed."""
    limit = _arg_max() - _ARGV_ROOM
    seen: set[int] = set()
    for r in ranks:
        if id(r.env) in seen:
            continue
        seen.add(id(r.env))
        sizes = {k: _size(k, v) for k, v in r.env.items()}
        for name, n in sizes.items():
            if n > MAX_ARG_STRLEN:
                raise LaunchError(
                    f"The environment variable {name} of rank {r.rank} is {_fmt(n)} ({n} "
                    f"bytes); Linux starts no process with a variable over {MAX_ARG_STRLEN} "
                    "bytes (E2BIG). Pass large data as an argument of the function (it "
                    "travels in the payload) or through a file, not in env=."
                )
        total = sum(sizes.values()) + 8 * len(sizes)
        if total > limit:
            big = sorted(sizes, key=sizes.__getitem__, reverse=True)[:3]
            names = ", ".join(f"{k} ({_fmt(sizes[k])})" for k in big)
            raise LaunchError(
                f"The environment of rank {r.rank} is {_fmt(total)} in all, over what Linux "
                f"lets a process start with ({_fmt(limit)}, E2BIG); the largest: {names}. "
                "Pass large data as an argument of the function or through a file."
            )
