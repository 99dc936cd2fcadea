"""How much room a disk has now: the caller's root-cause report for a rank that could not even
write its error record (the disk was full when it tried). Telling a full disk from an error, and
saying so, is `gangrun.wire.diskfull`'s.
"""

from __future__ import annotations

import os

NEARLY_FULL = 1 << 20  # bytes free under which a disk counts as full after the fact


def free_bytes(path: str) -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return int(st.f_bavail * st.f_frsize)


def looks_full(path: str) -> bool:
    """The disk of ``path`` has (almost) no room left now."""
    free = free_bytes(path)
    return free is not None and free < NEARLY_FULL


__all__ = ["free_bytes", "looks_full"]
