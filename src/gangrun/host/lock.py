"""Short exclusive sections on this host: ``with host_lock("name"):`` (``fcntl.flock``).

The lock file lives in this user's private lock directory
(``$XDG_RUNTIME_DIR/gangrun-locks`` or ``<tempdir>/gangrun-locks-<uid>``, 0700, verified as
the GPU reservation's is); names are hashed into `BUCKETS` files, so the directory never
grows (two unrelated names sharing a file only wait for each other's short section). The
kernel drops the lock when its holder dies. Used where a check and the write that follows
it must not interleave with another call's: resuming an MLflow run (`gangrun.tracking.lease`),
taking over a dead call's checkpoint location (`gangrun.checkpoint.writer`).

Scope: one user on one host. Threads of one process exclude each other too (one open file
description per section).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import time
from collections.abc import Iterator

from ..errors import LaunchError

BUCKETS = 64
_POLL_S = 0.01


@contextlib.contextmanager
def host_lock(name: str, timeout: float = 60.0) -> Iterator[None]:
    """Hold the lock of ``name`` for the block; a `LaunchError` after ``timeout`` seconds."""
    from .reservation import lock_dir

    bucket = int(hashlib.sha256(name.encode()).hexdigest(), 16) % BUCKETS
    path = os.path.join(lock_dir("gangrun-locks"), f"{bucket:02d}.lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise LaunchError(
                        f"{name}: another gangrun call of this user on this host held its lock "
                        f"({path}) for over {timeout:g}s; try again (a call stuck there can "
                        "be found with `gangrun ps`)."
                    ) from None
                time.sleep(_POLL_S)
        yield
    finally:
        os.close(fd)  # releases the lock


__all__ = ["host_lock", "BUCKETS"]
