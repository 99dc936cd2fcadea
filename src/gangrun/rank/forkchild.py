"""A child forked by the fork server becoming a rank: what a fresh interpreter would be.

Its own session and process group, default signal dispositions, only the fds it was given
(done by the server right after the fork), then here: the rank's environment (also in
``/proc/PID/environ``, so tools and the run sweep see it), std streams like a fresh
interpreter's (Python's and C's), fresh random seeds, ``OMP_NUM_THREADS`` applied to torch,
the server's death taken as the caller's; then `gangrun.rank.worker.main` loads the payload
(after the fork, so edited code is what runs).

``/proc/PID/environ`` room: the server was started with a `PAD_LEN`-byte padding
variable first in its environment block; a rank overwrites it with its own variables,
``GANGRUN_*`` and the torchrun variables first. Variables that do not fit are left out of
that *view* only (``os.environ`` in the rank has them all); `limits` keeps every
single variable under the kernel's exec limit, and ``GANGRUN_RUN_ID`` always fits.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Protocol

from ..host import system as platform
from ..wire import contract

PAD_LEN = 32 * 1024  # bytes reserved in the server's environ block for a rank's environment


class RankStart(Protocol):
    """What the fork server hands a child for its rank (its `ForkRank` message)."""

    @property
    def env(self) -> dict[str, str]: ...

    @property
    def cwd(self) -> str: ...


def pad_value() -> str:
    """The value of `ENVIRON_PAD` the server is started with."""
    return "x" * (PAD_LEN - len(contract.ENVIRON_PAD) - 2)


def become_rank(r: RankStart, fds: list[int], server_alive_r: int) -> None:
    out_w, err_w, live_r = fds
    os.dup2(out_w, 1)
    os.dup2(err_w, 2)
    os.close(out_w)
    os.close(err_w)
    env = dict(r.env)
    env[contract.LIVENESS_FD] = str(live_r)
    os.environ.clear()
    os.environ.update(env)
    publish_environ(env)
    if r.cwd:
        try:
            os.chdir(r.cwd)
        except OSError:
            pass  # the worker enters the caller's directory itself and reports failures
    reset_std_streams(env)
    platform.set_c_stdio_buffering(bool(env.get("PYTHONUNBUFFERED")))
    sys.dont_write_bytecode = bool(env.get("PYTHONDONTWRITEBYTECODE"))
    reseed(env)
    import importlib

    importlib.invalidate_caches()
    from . import boot

    boot.prepare_rank()
    # The server's death must take this rank down too (like the caller's): the same thread
    # watches both pipes (one gangrun thread in the rank's stacks, not two).
    from . import worker

    worker.also_watch(server_alive_r)
    worker.main()  # ends with os._exit


def publish_environ(env: dict[str, str]) -> None:
    """Make ``/proc/self/environ`` show the rank's environment.

    The kernel reports the environment block the process was exec'ed with; a forked child
    would show the server's. The child overwrites the server's padding variable in place (the
    rest of the block stays as it was, after an empty entry that ends the list for every
    reader)."""
    import ctypes

    pad_len = PAD_LEN
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        start = int(fields[47])  # env_start: field 50 of /proc/PID/stat
        head = (contract.ENVIRON_PAD + "=").encode()
        if start == 0 or ctypes.string_at(start, len(head)) != head:
            return
        first = [k for k in env if contract.ours(k)]
        first += ["RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]
        order = list(dict.fromkeys([k for k in first if k in env] + list(env)))
        blob = bytearray()
        for k in order:
            entry = os.fsencode(k) + b"=" + os.fsencode(env[k]) + b"\0"
            if len(blob) + len(entry) > pad_len - 1:
                continue  # not in the /proc view; os.environ has it
            blob += entry
        blob += b"\0" * (pad_len - len(blob))
        ctypes.memmove(start, bytes(blob), pad_len)
    except (OSError, ValueError, IndexError):
        return  # no procfs view to fix: the rank's os.environ is right anyway


def reset_std_streams(env: dict[str, str]) -> None:
    """New ``sys.stdout``/``sys.stderr`` over fds 1 and 2, set up as a fresh interpreter
    with this environment would (``PYTHONUNBUFFERED``, ``PYTHONIOENCODING``)."""
    import io

    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    enc_spec = env.get("PYTHONIOENCODING", "")
    enc, _, errs = enc_spec.partition(":")

    def make(fd: int, old: Any, errors_default: str) -> io.TextIOWrapper:
        raw = io.FileIO(fd, "w", closefd=False)
        tty = raw.isatty()
        buf: Any = raw if unbuffered else io.BufferedWriter(raw)
        return io.TextIOWrapper(
            buf,
            encoding=enc or getattr(old, "encoding", None) or "utf-8",
            errors=errs or getattr(old, "errors", None) or errors_default,
            line_buffering=tty or (fd == 2 and not unbuffered),
            write_through=unbuffered,
        )

    sys.stdout = make(1, sys.__stdout__, "strict")
    sys.stderr = make(2, sys.__stderr__, "backslashreplace")
    sys.__stdout__ = sys.stdout  # type: ignore[misc]
    sys.__stderr__ = sys.stderr  # type: ignore[misc]


def reseed(env: dict[str, str]) -> None:
    import random

    random.seed()
    np_random = sys.modules.get("numpy.random")  # not imported yet: seeded when it is
    if np_random is not None:
        try:
            np_random.seed()
        except Exception:  # an exotic numpy: its seed stays the server's
            pass
    torch = sys.modules.get("torch")
    if torch is None:
        return
    try:
        torch.default_generator.seed()  # a fresh interpreter gets a random CPU seed
    except Exception:  # a torch without a default generator: nothing to reseed
        pass
    n = env.get("OMP_NUM_THREADS", "")
    if n.strip().isdigit() and int(n) > 0:
        try:
            torch.set_num_threads(int(n))
        except Exception:  # torch refuses once its pool runs: it keeps the server's count
            pass
