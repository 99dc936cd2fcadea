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

Built on torch's own fsspec support (``FsspecWriter``/``FsspecReader``). Works in a process
group (every rank calls ``save``/``load``) and without one (a single process). Importing this
module does not import torch; the classes are created on first use.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import time
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

__all__ = [
    "MARKER",
    "IncompleteCheckpointError",
    "VolumeWriter",
    "VolumeReader",
    "is_complete",
    "latest",
    "list_checkpoints",
    "remove",
    "save",
    "load",
]

MARKER = "_COMPLETE"
_LOCAL = ("file", "local")


class IncompleteCheckpointError(FileNotFoundError):
    """The checkpoint directory has no commit marker: it was never finished."""


def filesystem(
    url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None
) -> tuple[AbstractFileSystem, str]:
    from fsspec.core import url_to_fs

    return url_to_fs(os.fspath(url), **(storage_options or {}))


def _protocol(fs: Any) -> str:
    return fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]


def _natural(s: str) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


def _invalidate(fs: Any, root: str) -> None:
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
    _invalidate(fs, path.rstrip("/"))
    return bool(fs.exists(path.rstrip("/") + "/" + MARKER))


def list_checkpoints(url: str | os.PathLike[str], **storage_options: Any) -> list[str]:
    """The complete checkpoints directly under ``url``, oldest first (by commit time)."""
    fs, root = filesystem(url, storage_options)
    root = root.rstrip("/")
    _invalidate(fs, root)  # listings cached by s3fs & co. miss other processes' saves
    try:
        markers = fs.glob(f"{root}/*/{MARKER}")
    except FileNotFoundError:
        return []
    found = []
    for m in markers:
        d = m[: -len(MARKER) - 1]
        try:
            info = json.loads(fs.cat_file(m) or b"{}")
            t = float(info.get("time", 0.0))
        except (ValueError, OSError, AttributeError):
            t = 0.0
        found.append((t, _natural(d.rsplit("/", 1)[-1]), d))
    found.sort()
    src = os.fspath(url)
    out = []
    for _, _, d in found:
        if "://" in src or _protocol(fs) not in _LOCAL:
            out.append(fs.unstrip_protocol(d))
        else:
            out.append(d)
    return out


def latest(url: str | os.PathLike[str], **storage_options: Any) -> str | None:
    """The newest complete checkpoint directly under ``url`` (``None`` if there is none).

    Newest = latest commit time recorded in the marker, ties broken by the directory name
    (numbers compared as numbers, so ``step-10`` is after ``step-9``).
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


_classes: dict[str, type] = {}


def storage_classes() -> dict[str, type]:
    if _classes:
        return _classes
    from .._compat_imports import TORCH_SUPPORTED, private_import

    # Not re-exported by torch: the guard names the supported torch versions if it moves.
    private = "torch.distributed.checkpoint._fsspec_filesystem"
    FsspecReader: Any = private_import(private, "FsspecReader", supported=TORCH_SUPPORTED)
    FsspecWriter: Any = private_import(private, "FsspecWriter", supported=TORCH_SUPPORTED)

    class _VolumeWriter(FsspecWriter):
        """Storage writer for ``torch.distributed.checkpoint.save`` on any fsspec URL.

        ``sync_files`` defaults to True on the local filesystem and False elsewhere (object
        stores have no fsync; torch would fall back to a machine-wide ``sync``).
        """

        def __init__(
            self,
            url: str | os.PathLike[str],
            *,
            sync_files: bool | None = None,
            thread_count: int = 1,
            overwrite: bool = True,
            **storage_options: Any,
        ) -> None:
            url = os.fspath(url)
            fs, _ = filesystem(url, storage_options)
            if sync_files is None:
                sync_files = _protocol(fs) in _LOCAL
            super().__init__(
                url,
                sync_files=sync_files,
                thread_count=thread_count,
                overwrite=overwrite,
                **storage_options,
            )
            self.url = url
            self._coordinator = False

        def _marker(self) -> str:
            return str(self.fs.concat_path(self.path, MARKER))

        def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
            super().set_up_storage_writer(is_coordinator, *args, **kwargs)
            self._coordinator = is_coordinator
            # Runs before any rank writes (their plans come from the coordinator): an old
            # marker must go first, so a half-overwritten checkpoint never looks complete.
            if is_coordinator:
                self.fs.mkdir(self.path)
                if self.fs.exists(self._marker()):
                    self.fs.rm_file(self._marker())

        def finish(self, metadata: Any, results: Any) -> None:
            # Called on the coordinator once every rank's write_data has completed.
            super().finish(metadata, results)
            if not self.use_collectives:
                return  # no coordination: nothing can vouch for the other ranks
            info = {
                "time": time.time(),
                "ranks": len(results),
                "host": socket.gethostname(),
                "save_id": self.save_id,
            }
            with self.fs.create_stream(self._marker(), "wb") as f:
                f.write(json.dumps(info).encode())

    class _VolumeReader(FsspecReader):
        """Storage reader for ``torch.distributed.checkpoint.load``; refuses incomplete ones."""

        def __init__(
            self,
            url: str | os.PathLike[str],
            *,
            require_complete: bool = True,
            **storage_options: Any,
        ) -> None:
            url = os.fspath(url)
            super().__init__(url, **storage_options)
            self.url = url
            self.require_complete = require_complete

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if self.require_complete and not self.fs.exists(
                str(self.fs.concat_path(self.path, MARKER))
            ):
                raise IncompleteCheckpointError(
                    f"{self.url} is not a complete checkpoint (no {MARKER} marker: its save "
                    f"did not finish). Use gangrun.checkpoint.latest() to find the last good one."
                )
            return super().read_metadata(*args, **kwargs)

    _VolumeWriter.__name__ = _VolumeWriter.__qualname__ = "VolumeWriter"
    _VolumeReader.__name__ = _VolumeReader.__qualname__ = "VolumeReader"
    _VolumeWriter.__module__ = _VolumeReader.__module__ = __name__
    _classes["VolumeWriter"] = _VolumeWriter
    _classes["VolumeReader"] = _VolumeReader
    return _classes


if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    class VolumeWriter(FsspecWriter):  # keywords: see storage_classes()'s _VolumeWriter
        url: str

        def __init__(self, url: str | os.PathLike[str], **options: Any) -> None: ...

    class VolumeReader(FsspecReader):
        url: str
        require_complete: bool

        def __init__(
            self,
            url: str | os.PathLike[str],
            *,
            require_complete: bool = True,
            **storage_options: Any,
        ) -> None: ...


def __getattr__(name: str) -> Any:
    if name in ("VolumeWriter", "VolumeReader"):
        cls = storage_classes()[name]
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _no_dist() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized())


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    # torch warns on every single-process save/load; here that is the intended use.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


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
    import torch.distributed.checkpoint as dcp

    writer = storage_classes()["VolumeWriter"](url, **(storage_options or {}), **writer_kwargs)
    with _quiet_single_process():
        dcp.save(state, storage_writer=writer, process_group=process_group, no_dist=_no_dist())
    return os.fspath(url)


def load(
    state: dict[str, Any],
    url: str | os.PathLike[str],
    *,
    process_group: Any = None,
    storage_options: dict[str, Any] | None = None,
    **reader_kwargs: Any,
) -> dict[str, Any]:
    """Load checkpoint ``url`` into ``state`` in place (``Stateful`` values get
    ``load_state_dict``); raises `IncompleteCheckpointError` for an unfinished one.
    Returns ``state``."""
    import torch.distributed.checkpoint as dcp

    reader = storage_classes()["VolumeReader"](url, **(storage_options or {}), **reader_kwargs)
    if reader.require_complete and not is_complete(url, **(storage_options or {})):
        # Checked here too so the error is not wrapped in torch's CheckpointException.
        raise IncompleteCheckpointError(
            f"{os.fspath(url)} is not a complete checkpoint (no {MARKER} marker: its save did "
            f"not finish). Use gangrun.checkpoint.latest() to find the last good one."
        )
    with _quiet_single_process():
        dcp.load(state, storage_reader=reader, process_group=process_group, no_dist=_no_dist())
    return state
