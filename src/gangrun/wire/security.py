"""Checks that keep one user's run private from other users of the node (docs/security.md).

Pickles are code: gangrun unpickles only files in a directory that this user owns and that
nobody else can write (mode ``0700``), and only files this user owns that nobody else can
write. A run directory or file that fails the check is never loaded.

Log directories (``log_dir=``, often in a shared place) are created with
`make_private_dir`, which never follows a symlink another user could have planted, and
log files are opened with `open_log` (``O_NOFOLLOW``, owner-only).

Secrets in URIs (``http://alice:PASSWORD@host``, which MLflow accepts as a tracking URI):
`redact` replaces the password (or a bare ``token@``) with ``***`` in any text gangrun
prints, logs or writes into a call's record; `credentials` splits them off for a request.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from collections import deque
from typing import Any, BinaryIO

from .errors import LaunchError

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_MAX_LINKS = 40  # symlinks followed in one path, as the kernel's own limit


class UnsafePathError(PermissionError):
    """A path gangrun would load from is not private to this user."""


def _owner_problem(st: os.stat_result) -> str | None:
    """Why an entry with this ``stat`` is not this user's, or None."""
    if st.st_uid != os.getuid():
        return f"is owned by uid {st.st_uid}, not by this user ({os.getuid()})"
    return None


def check_private_dir(path: str) -> None:
    """``path`` is a real directory (no symlink), owned by this user, mode ``0700`` or stricter."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise UnsafePathError(f"{path} is not a directory (or is a symlink); not loading from it.")
    problem = _owner_problem(st)
    if problem:
        raise UnsafePathError(f"{path} {problem}; not loading from it.")
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

        return load_file(f)


def _refuse(path: str, why: str) -> LaunchError:
    return LaunchError(
        f"log directory {path!r}: {why}. gangrun writes rank logs only into directories that "
        "no other user can redirect; pass a log_dir= you own that is not reached through "
        "another user's symlink or shared directory (e.g. one under your home directory)."
    )


def _trusted_owner(uid: int) -> bool:
    return uid in (os.getuid(), 0)


def make_private_dir(path: str) -> str:
    """Create directory ``path`` and every missing component, each mode ``0700``; return
    ``path`` made absolute.

    The path is walked one component at a time with ``O_NOFOLLOW`` directory descriptors, so
    nothing can be swapped in between a check and its use. A symlink on the way is followed
    only when it belongs to this user or root (system links such as ``/var/run``); the last
    component must be a real directory owned by this user. An existing directory on the way
    that another (non-root) user owns and that others may write is refused (its owner could
    swap what gangrun creates in it). Components gangrun creates get mode ``0700`` whatever
    the umask. Anything else raises [`LaunchError`][gangrun.errors.LaunchError] naming the path.
    """
    full = os.path.abspath(os.fspath(path))
    todo = deque(c for c in full.split("/") if c)
    fd = os.open("/", _DIR_FLAGS)
    where = "/"  # the directory fd refers to, for messages
    links = 0
    try:
        while todo:
            name = todo.popleft()
            last = not todo
            here = os.path.join(where, name)
            created = False
            try:
                sub = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                try:
                    os.mkdir(name, 0o700, dir_fd=fd)
                except FileExistsError as exc:  # made meanwhile: look at it again
                    links += 1
                    if links > _MAX_LINKS:
                        raise _refuse(full, f"{here} keeps changing") from exc
                    todo.appendleft(name)
                    continue
                except OSError as exc:
                    raise _refuse(full, f"cannot create {here}: {exc.strerror}") from exc
                created = True
                try:
                    sub = os.open(name, _DIR_FLAGS, dir_fd=fd)
                except OSError as exc:  # replaced (by a symlink) right after mkdir
                    raise _refuse(full, f"{here} was replaced while it was created") from exc
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise _refuse(full, f"cannot open {here}: {exc.strerror}") from exc
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                if not stat.S_ISLNK(st.st_mode):
                    raise _refuse(full, f"{here} exists and is not a directory") from exc
                if last:
                    raise _refuse(full, f"{here} is a symlink (owned by uid {st.st_uid})") from exc
                if not _trusted_owner(st.st_uid):
                    raise _refuse(
                        full, f"{here} is a symlink owned by another user (uid {st.st_uid})"
                    ) from exc
                links += 1
                if links > _MAX_LINKS:
                    raise _refuse(full, "too many levels of symlinks") from exc
                target = os.readlink(name, dir_fd=fd)
                todo.extendleft(reversed([c for c in target.split("/") if c]))
                if target.startswith("/"):
                    os.close(fd)
                    fd = os.open("/", _DIR_FLAGS)
                    where = "/"
                continue
            try:
                st = os.fstat(sub)
                if created or last:
                    problem = _owner_problem(st)
                    if problem:
                        raise _refuse(full, f"{here} {problem}")
                    if created:
                        os.fchmod(sub, 0o700)  # mkdir's mode is cut by the umask; set it exactly
                elif not _trusted_owner(st.st_uid) and st.st_mode & 0o022:
                    raise _refuse(
                        full,
                        f"{here} belongs to uid {st.st_uid} and others can write it "
                        f"(mode {stat.S_IMODE(st.st_mode):o})",
                    )
            except BaseException:
                os.close(sub)
                raise
            os.close(fd)
            fd, where = sub, here
    finally:
        os.close(fd)
    return full


def open_log(path: str) -> BinaryIO:
    """Open (create, mode ``0600``) log file ``path`` for appending, unbuffered.

    ``O_NOFOLLOW``: a symlink at ``path`` is refused, never followed; so is anything that is
    not a regular file owned by this user (checked on the open descriptor). An existing log of
    ours that others could read is narrowed to ``0600``. Raises
    [`LaunchError`][gangrun.errors.LaunchError] naming the path.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            why = "it is a symlink; gangrun does not follow symlinks to log files"
        elif exc.errno == errno.ENXIO:
            why = "it is a FIFO or socket, not a regular file"
        else:
            why = exc.strerror or str(exc)
        raise LaunchError(
            f"cannot open rank log {path!r}: {why}. Remove it, or choose another log_dir=."
        ) from exc
    try:
        st = os.fstat(fd)
        problem = _owner_problem(st) if stat.S_ISREG(st.st_mode) else "is not a regular file"
        if problem:
            raise LaunchError(
                f"rank log {path!r} {problem}; not writing to it. Remove it, or choose "
                "another log_dir=."
            )
        if st.st_mode & 0o077:
            os.fchmod(fd, 0o600)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "ab", buffering=0)


# scheme://user:password@ or scheme://token@ (the password may hold '@': up to the last one
# of the authority, as urllib and requests read it)
_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*://)([^\s/@:?#]*)(?::([^\s/?#]*))?@")


def redact(text: str) -> str:
    """``text`` with the password of every ``scheme://user:password@`` in it replaced by
    ``***`` (``http://alice:***@host``), and a bare ``scheme://token@`` by ``***@``."""
    if "@" not in text:
        return text

    def hide(m: re.Match[str]) -> str:
        scheme, user, password = m.group(1), m.group(2), m.group(3)
        return f"{scheme}{user}:***@" if password is not None else f"{scheme}***@"

    return _USERINFO.sub(hide, text)


def credentials(uri: str) -> tuple[str, str | None, str | None]:
    """``(uri without its user:password@ part, user, password)`` (percent-decoded; ``None``
    when the URI has none)."""
    from urllib.parse import unquote, urlsplit, urlunsplit

    try:
        parts = urlsplit(uri)
    except ValueError:
        return uri, None, None
    userinfo, at, host = parts.netloc.rpartition("@")
    if not at:
        return uri, None, None
    user, colon, password = userinfo.partition(":")
    clean = urlunsplit(parts._replace(netloc=host))
    return clean, unquote(user), unquote(password) if colon else None


__all__ = [
    "UnsafePathError",
    "credentials",
    "redact",
    "check_private_dir",
    "check_private_file",
    "load_private",
    "make_private_dir",
    "open_log",
]
