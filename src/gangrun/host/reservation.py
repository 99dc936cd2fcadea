"""Per-node GPU reservation: concurrent calls never share a GPU.

Each GPU a call runs on is held with an exclusive ``fcntl.flock`` on a lock file named after
the GPU (its UUID when known, else its physical index) in a per-user private directory
(``$XDG_RUNTIME_DIR/gangrun-gpus`` or ``<tempdir>/gangrun-gpus-<uid>``, mode 0700). The lock
works across threads of one caller and across caller processes (several notebooks of one
user); the kernel drops it when the holder's file descriptor closes, so a caller that dies
(kernel restart, SIGKILL) frees its GPUs at once. The lock files are opened close-on-exec:
ranks never inherit them.

Scope: reservations are per user. Another user's jobs on the same node are not visible here
(the directory is private on purpose, see ``docs/security.md``).
"""

from __future__ import annotations

import fcntl
import os
import stat
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..errors import LaunchError

if TYPE_CHECKING:
    from .accelerators import Accelerator

POLL_S = 0.1
# flock is per open file description: two threads of one caller opening the same file get two
# descriptions and do exclude each other. This lock only serialises the pick-and-lock step.
_pick_lock = threading.Lock()


def lock_dir(name: str = "gangrun-gpus") -> str:
    """The private directory holding this user's GPU lock files (created 0700, verified);
    ``name``: another such directory (`gangrun.host.lock`)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime) and os.access(runtime, os.W_OK):
        path = os.path.join(runtime, name)
    else:
        path = os.path.join(tempfile.gettempdir(), f"{name}-{os.getuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass  # made by an earlier call: it is verified just below like a new one
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise LaunchError(
            f"The lock directory {path} is not a private directory of this user "
            f"(owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}); refusing to use it. "
            "Remove it, or set XDG_RUNTIME_DIR to a private directory."
        )
    return path


def _key(dev: Accelerator) -> str:
    safe = "".join(c for c in dev.uuid if c.isalnum() or c in "-_")
    return f"gpu-{safe}" if safe else f"gpu-{int(dev.index)}"


class Reservation:
    """GPUs held by one call; ``release()`` (idempotent) frees them."""

    def __init__(self, devices: list[Any], fds: list[int]) -> None:
        self.devices = devices
        self._fds = fds
        self._lock = threading.Lock()

    @property
    def indices(self) -> list[int]:
        return [int(d.index) for d in self.devices]

    def release(self) -> None:
        with self._lock:
            fds, self._fds = self._fds, []
        for fd in fds:
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            except OSError:
                pass  # closing the descriptor below releases the lock anyway
            try:
                os.close(fd)
            except OSError:
                pass  # already closed: the lock is released either way

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _try_pick(pool: Sequence[Any], want: int, directory: str) -> Reservation | None:
    held: list[tuple[Any, int]] = []
    try:
        return _pick(pool, want, directory, held)
    except BaseException:  # e.g. Ctrl-C while waiting: drop what was taken
        Reservation([], [fd for _, fd in held]).release()
        raise


def _pick(pool: Sequence[Any], want: int, directory: str, held: list[tuple[Any, int]]) -> Any:
    with _pick_lock:
        for dev in pool:
            if len(held) == want:
                break
            path = os.path.join(directory, _key(dev) + ".lock")
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                continue
            try:  # for humans looking at the directory: who holds it
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()}\n".encode())
            except OSError:
                pass  # the pid note is for humans only; the flock is what reserves the GPU
            held.append((dev, fd))
        if len(held) == want:
            return Reservation([d for d, _ in held], [fd for _, fd in held])
    Reservation([], [fd for _, fd in held]).release()
    return None


def reserve_exact(devices: Sequence[Any], wait: float | None = 0.0) -> Reservation:
    """Reserve exactly ``devices`` (``gpus=[0, 3]``, see ``accelerators.select_devices``).

    Raises ``LaunchError`` naming each busy one and the pid of the caller holding it."""
    return reserve(devices, len(devices), wait, exact=True)


def reserve_wanted(pool: Sequence[Any], want: Any, wait: float | None = 0.0) -> Reservation:
    """A call's GPUs: ``want`` of them out of ``pool`` (an int), or exactly ``pool`` (a list of
    device indices, already resolved to ``pool``). Concurrent calls never share a GPU."""
    if isinstance(want, int):
        return reserve(pool, want, wait)
    return reserve_exact(pool, wait)


def reserve(
    pool: Sequence[Any], want: int, wait: float | None = 0.0, exact: bool = False
) -> Reservation:
    """Reserve ``want`` GPUs out of ``pool`` (in ``pool`` order, free ones first).

    ``wait``: seconds to wait for busy GPUs to be released; ``0`` fails at once, ``None``
    waits without limit. Raises ``LaunchError`` naming the busy GPUs and their holders.
    ``exact``: the pool was named by the user (``gpus=[...]``); the error says so.
    """
    if want > len(pool):
        raise LaunchError(f"{want} GPU(s) requested but only {len(pool)} visible.")
    directory = lock_dir()
    deadline = None if wait is None else time.monotonic() + max(0.0, wait)
    while True:
        got = _try_pick(pool, want, directory)
        if got is not None:
            return got
        if deadline is not None and time.monotonic() >= deadline:
            break
        time.sleep(
            POLL_S if deadline is None else max(0.0, min(POLL_S, deadline - time.monotonic()))
        )
    busy = []
    for dev in pool:
        path = os.path.join(directory, _key(dev) + ".lock")
        try:
            with open(path) as f:
                holder = f.read().strip()
        except OSError:
            holder = ""
        if holder and _held(path):
            busy.append(f"GPU {dev.index} (caller pid {holder})")
    waited = "" if not wait else f" after waiting {wait:g}s"
    if exact:
        raise LaunchError(
            f"gpus={[int(d.index) for d in pool]!r}: busy{waited}: "
            f"{', '.join(busy) or '?'} held by another gangrun call of this user. Wait for it "
            "to finish or cancel it, pick other GPUs, or let the call wait for them with "
            "gpu_wait=SECONDS (None: no limit)."
        )
    raise LaunchError(
        f"Not enough free GPUs{waited}: this call needs {want} of {len(pool)}, but "
        f"{len(busy)} are in use by other gangrun calls of this user: {', '.join(busy) or '?'}. "
        "Wait for them to finish, cancel them, ask for fewer GPUs (gpus=N), or let the call "
        "wait for free GPUs with gpu_wait=SECONDS (None: no limit)."
    )


def _held(path: str) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


__all__ = ["Reservation", "reserve", "reserve_exact", "lock_dir"]
