"""Checks that keep one user's run private from other users of the node (docs/security.md).

Pickles are code: gangrun unpickles only files in a directory that this user owns and that
nobody else can write (mode ``0700``), and only files this user owns that nobody else can
write. A run directory or file that fails the check is never loaded.
"""

from __future__ import annotations

import os
import stat
from typing import Any


class UnsafePathError(PermissionError):
    """A path gangrun would load from is not private to this user."""


def check_private_dir(path: str) -> None:
    """``path`` is a real directory (no symlink), owned by this user, mode ``0700`` or stricter."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise UnsafePathError(f"{path} is not a directory (or is a symlink); not loading from it.")
    if st.st_uid != os.getuid():
        raise UnsafePathError(
            f"{path} is owned by uid {st.st_uid}, not by this user ({os.getuid()}); "
            "not loading from it."
        )
    if st.st_mode & 0o077:
        raise UnsafePathError(
            f"{path} has mode {stat.S_IMODE(st.st_mode):o}: other users can reach it; "
            "a run directory must be 0700. Not loading from it."
        )


def check_private_file(path: str) -> None:
    """``path`` is a regular file (no symlink) owned by this user and not writable by others."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISREG(st.st_mode):
        raise UnsafePathError(f"{path} is not a regular file (or is a symlink); not loading it.")
    if st.st_uid != os.getuid():
        raise UnsafePathError(
            f"{path} is owned by uid {st.st_uid}, not by this user; not loading it."
        )
    if st.st_mode & 0o022:
        raise UnsafePathError(
            f"{path} has mode {stat.S_IMODE(st.st_mode):o}: other users can write it; not loading it."
        )


def load_private(path: str) -> Any:
    """Unpickle ``path`` after checking that it and its directory are private to this user."""
    check_private_dir(os.path.dirname(os.path.abspath(path)))
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if os.path.islink(path):
            raise UnsafePathError(f"{path} is a symlink; not loading it.") from exc
        raise
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
            check_private_file(path)  # raises with the precise reason
            raise UnsafePathError(f"{path} is not a private file of this user; not loading it.")
        from .serialization import load_file

        return load_file(f)  # type: ignore[arg-type]


__all__ = ["UnsafePathError", "check_private_dir", "check_private_file", "load_private"]
