"""A full disk, said as such: which file could not be written, and whose disk is full.

Every writer of the run directory uses it: the caller's payload and context (a
[`LaunchError`][gangrun.errors.LaunchError]), a rank's result and error record (the rank's error
names the directory, the ``OSError`` is its cause), the rank logs (a warning). How much room a
disk has now is the machine's business: `gangrun.host.diskspace`.
"""

from __future__ import annotations

import errno
import os

FULL = frozenset({errno.ENOSPC, errno.EDQUOT})


def is_full(exc: BaseException) -> bool:
    """``exc`` says the disk (or the user's quota) has no room left."""
    return isinstance(exc, OSError) and exc.errno in FULL


def full_message(what: str, path: str, exc: BaseException) -> str:
    """``could not write <what>: the disk of <dir> is full (...)`` and what to do."""
    directory = path if os.path.isdir(path) else os.path.dirname(path) or "."
    reason = getattr(exc, "strerror", None) or str(exc)
    return (
        f"could not write {what}: the disk of {directory} is full ({reason}). "
        "Free space there, or point TMPDIR (where run directories go) or log_dir= at a disk "
        "with room."
    )


__all__ = ["FULL", "is_full", "full_message"]
