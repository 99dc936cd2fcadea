"""``torch.distributed.checkpoint`` on any fsspec URL, visible only once complete.

>>> from gangrun import checkpoint
>>> checkpoint.save({"model": model.state_dict(), "step": step}, f"s3://b/run/step-{step:08d}")
>>> last = checkpoint.latest("s3://b/run")          # newest *complete* checkpoint, or None
>>> if last: checkpoint.load(state, last)

A checkpoint directory holds torch's files (one or more ``.distcp`` per rank and
``.metadata``) plus a commit marker, ``_COMPLETE``, that the coordinator (rank 0) writes last,
in `VolumeWriter.finish`, which ``torch.distributed.checkpoint.save`` calls only after
every rank has written its data. A crash anywhere before that leaves no marker: the directory
is ignored by [`latest`][gangrun.checkpoint.latest] and refused by `VolumeReader`. Saving again into an existing
checkpoint first removes its marker.

The marker is also the checkpoint's manifest: every file (relative path) with its size, and
the CRC-32 of the files DCP wrote, computed by each rank as it writes them (how, and what it
costs: `gangrun.checkpoint.manifest`). A file damaged later (truncated, deleted) makes the
checkpoint *damaged*; one corrupted at the same size is found with ``checksums=True``:

>>> checkpoint.verify(last).problems           # [] or what is missing / of another size
>>> found, skipped = checkpoint.newest_valid("s3://b/run")   # the damaged ones skipped
>>> checkpoint.scan("s3://b/run")              # every checkpoint: complete, damaged, partial

`load` checks the sizes first (one listing) and raises `DamagedCheckpointError` naming the
checkpoint and the file, also when torch's reader fails on a file. A ``Checkpointer``
restores the newest *valid* checkpoint; ``gangrun checkpoints URL`` lists them from a shell.
Markers without a manifest (older gangrun) are complete but unverifiable.

Built on torch's own fsspec support (``FsspecWriter``/``FsspecReader``). Works in a process
group (every rank calls ``save``/``load``) and without one (a single process). Importing this
module does not import torch: the I/O (`gangrun.checkpoint.volume`: the writer, the reader, the
one place a checkpoint is written) is imported on first use.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

__all__ = [
    "MARKER",
    "IncompleteCheckpointError",
    "DamagedCheckpointError",
    "CheckpointReport",
    "Problem",
    "VolumeWriter",
    "VolumeReader",
    "is_complete",
    "latest",
    "list_checkpoints",
    "remove",
    "save",
    "load",
    "verify",
    "scan",
    "newest_valid",
]

MARKER = "_COMPLETE"
_LOCAL = ("file", "local")


class IncompleteCheckpointError(FileNotFoundError):
    """The checkpoint directory has no commit marker: it was never finished."""


class DamagedCheckpointError(ValueError):
    """A complete checkpoint (it has its commit marker) whose files are no longer what was
    written: ``file`` (relative to the checkpoint ``url``) is missing, of another size, or
    unreadable."""

    def __init__(self, message: str, *, url: str = "", file: str = "") -> None:
        super().__init__(message)
        self.url, self.file = url, file

    def __reduce__(self) -> Any:  # keyword-only fields survive pickling (between ranks)
        return (_damaged, (str(self), self.url, self.file))


def _damaged(message: str, url: str, file: str) -> DamagedCheckpointError:
    return DamagedCheckpointError(message, url=url, file=file)


def filesystem(
    url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None
) -> tuple[AbstractFileSystem, str]:
    from fsspec.core import url_to_fs

    return url_to_fs(os.fspath(url), **(storage_options or {}))


def _protocol(fs: Any) -> str:
    return fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]


def is_local(fs: Any) -> bool:
    """``fs`` (an fsspec filesystem) is this machine's own."""
    return _protocol(fs) in _LOCAL


def natural_key(s: str) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


def invalidate_listing(fs: Any, root: str) -> None:
    """Forget cached listings of ``root`` and everything under it: other processes write
    checkpoints (s3fs & co. invalidate a path and its parents, not its children)."""
    fs.invalidate_cache(root)
    cache = getattr(fs, "dircache", None)
    if cache:
        for key in [k for k in list(cache) if str(k).startswith(root + "/")]:
            cache.pop(key, None)


def is_complete(url: str | os.PathLike[str], **storage_options: Any) -> bool:
    """Whether ``url`` is a finished checkpoint (its commit marker exists)."""
    fs, path = filesystem(url, storage_options)
    invalidate_listing(fs, path.rstrip("/"))
    return bool(fs.exists(path.rstrip("/") + "/" + MARKER))


def list_checkpoints(url: str | os.PathLike[str], **storage_options: Any) -> list[str]:
    """The complete checkpoints directly under ``url``, oldest first (by commit time)."""
    fs, root = filesystem(url, storage_options)
    root = root.rstrip("/")
    invalidate_listing(fs, root)  # listings cached by s3fs & co. miss other processes' saves
    try:
        markers = fs.glob(f"{root}/*/{MARKER}")
    except FileNotFoundError:
        return []
    found = []
    for m in markers:
        d = m[: -len(MARKER) - 1]
        found.append((_commit_time(fs, m), natural_key(d.rsplit("/", 1)[-1]), d))
    found.sort()
    src = os.fspath(url)
    return [public_path(fs, src, d) for _, _, d in found]


def _commit_time(fs: Any, marker: str) -> float:
    """The commit time marker ``marker`` records; for one that records none (empty, torn,
    not JSON), when the storage says it was written: such a checkpoint is listed where it
    was made (its marker is verified, and found damaged, like any other's), not as the
    oldest, which a restore would pass over without a word."""
    try:
        return float(json.loads(fs.cat_file(marker))["time"])
    except (ValueError, OSError, KeyError, TypeError):
        pass
    try:
        return stored_time(fs.info(marker)) or 0.0
    except OSError:
        return 0.0


def stored_time(info: dict[str, Any]) -> float | None:
    """When the storage says a file was written (fsspec's ``info``), or None."""
    for key in ("mtime", "LastModified", "last_modified", "updated", "created"):
        v: Any = info.get(key)
        if isinstance(v, (int, float)):
            return float(v)
        if v is not None and hasattr(v, "timestamp"):
            return float(v.timestamp())
    return None


def public_path(fs: Any, src: str, path: str) -> str:
    """``path`` (fsspec's, without protocol) as the user named its location ``src``."""
    if "://" in src or not is_local(fs):
        return str(fs.unstrip_protocol(path))
    return path


def latest(url: str | os.PathLike[str], **storage_options: Any) -> str | None:
    """The newest complete checkpoint directly under ``url`` (``None`` if there is none).

    Newest = latest commit time recorded in the marker, ties broken by the directory name
    (numbers compared as numbers, so ``step-10`` is after ``step-9``). Its files are not
    checked: `newest_valid` skips checkpoints damaged since their commit.
    """
    found = list_checkpoints(url, **storage_options)
    return found[-1] if found else None


def remove(url: str | os.PathLike[str], **storage_options: Any) -> None:
    """Delete checkpoint ``url``: its commit marker first, so a half-deleted checkpoint is
    never taken for a complete one."""
    fs, path = filesystem(url, storage_options)
    path = path.rstrip("/")
    with contextlib.suppress(FileNotFoundError):
        fs.rm_file(path + "/" + MARKER)
    with contextlib.suppress(FileNotFoundError):
        fs.rm(path, recursive=True)


if TYPE_CHECKING:  # reached on first use (`__getattr__`): the module imports torch
    from .volume import VolumeReader, VolumeWriter


def __getattr__(name: str) -> Any:
    if name in ("VolumeWriter", "VolumeReader"):
        from . import volume

        cls = getattr(volume, name)
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def save(
    state: dict[str, Any],
    url: str | os.PathLike[str],
    *,
    process_group: Any = None,
    storage_options: dict[str, Any] | None = None,
    **writer_kwargs: Any,
) -> str:
    """Save ``state`` (tensors, ``Stateful`` objects, plain values) to checkpoint ``url``.

    Call it on every rank when a process group is initialised (each rank writes its shards,
    rank 0 commits); in a single process it just saves. Returns ``url``.
    """
    from . import volume

    volume.write(
        state,
        url,
        process_group=process_group,
        storage_options=storage_options,
        **writer_kwargs,
    )
    return os.fspath(url)


def load(
    state: dict[str, Any],
    url: str | os.PathLike[str],
    *,
    process_group: Any = None,
    storage_options: dict[str, Any] | None = None,
    verify: bool = True,
    **reader_kwargs: Any,
) -> dict[str, Any]:
    """Load checkpoint ``url`` into ``state`` in place (``Stateful`` values get
    ``load_state_dict``); raises `IncompleteCheckpointError` for an unfinished one and
    `DamagedCheckpointError` for a damaged one: a file missing or of another size than its
    manifest records (checked first, with ``verify``: one listing), or one torch's reader
    fails on. Returns ``state``."""
    from . import volume

    return volume.read(
        state,
        url,
        process_group=process_group,
        storage_options=storage_options,
        verify=verify,
        **reader_kwargs,
    )


from .integrity import CheckpointReport, Problem, newest_valid, scan, verify  # noqa: E402
