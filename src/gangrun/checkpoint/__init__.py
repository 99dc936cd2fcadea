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
        try:
            info = json.loads(fs.cat_file(m) or b"{}")
            t = float(info.get("time", 0.0))
        except (ValueError, OSError, AttributeError):
            t = 0.0
        found.append((t, natural_key(d.rsplit("/", 1)[-1]), d))
    found.sort()
    src = os.fspath(url)
    return [public_path(fs, src, d) for _, _, d in found]


def public_path(fs: Any, src: str, path: str) -> str:
    """``path`` (fsspec's, without protocol) as the user named its location ``src``."""
    if "://" in src or _protocol(fs) not in _LOCAL:
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


_classes: dict[str, type] = {}


def storage_classes() -> dict[str, type]:
    if _classes:
        return _classes
    from .._compat_imports import TORCH_SUPPORTED, private_import
    from . import integrity as _i
    from . import manifest as _v

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
            self._storage_options = dict(storage_options)
            self._written: dict[str, list[Any]] = {}  # this rank's files: [size, crc32]
            _v.tap_streams(self.fs, lambda: self.path, self._written)

        def reset(self, checkpoint_id: Any = None) -> None:
            super().reset(checkpoint_id)
            if checkpoint_id:
                self.url = os.fspath(checkpoint_id)

        def _marker(self) -> str:
            return str(self.fs.concat_path(self.path, MARKER))

        def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
            super().set_up_storage_writer(is_coordinator, *args, **kwargs)
            # Runs before any rank writes (their plans come from the coordinator): an old
            # marker must go first, so a half-overwritten checkpoint never looks complete.
            if is_coordinator:
                self.fs.mkdir(self.path)
                if self.fs.exists(self._marker()):
                    self.fs.rm_file(self._marker())

        def write_data(self, plan: Any, planner: Any) -> Any:
            # Every file of this rank goes through the tap (size, CRC-32 as it is written);
            # the list travels to the coordinator as one more write result.
            from torch.futures import Future

            self._written.clear()
            results = list(super().write_data(plan, planner).wait())
            results.append(_v.rank_result(dict(self._written)))
            fut: Any = Future()
            fut.set_result(results)
            return fut

        def finish(self, metadata: Any, results: Any) -> None:
            # Called on the coordinator once every rank's write_data has completed.
            results, written = _v.split_results(results)
            self._written.clear()
            super().finish(metadata, results)
            if not self.use_collectives:
                return  # no coordination: nothing can vouch for the other ranks
            written.update(self._written)  # .metadata, written just now
            info = {
                "time": time.time(),
                "ranks": len(results),
                "host": socket.gethostname(),
                "save_id": self.save_id,
                _v.FILES: _v.build_manifest(self.url, self._storage_options, written),
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
            self._storage_options = dict(storage_options)
            self.damaged: DamagedCheckpointError | None = None  # what this rank could not read

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if self.require_complete and not self.fs.exists(
                str(self.fs.concat_path(self.path, MARKER))
            ):
                raise IncompleteCheckpointError(
                    f"{self.url} is not a complete checkpoint (no {MARKER} marker: its save "
                    f"did not finish). Use gangrun.checkpoint.latest() to find the last good one."
                )
            if kwargs.get("rank") is not None:  # DCP's fallback to per-rank metadata
                return super().read_metadata(*args, **kwargs)
            try:
                return super().read_metadata(*args, **kwargs)
            except Exception as exc:
                raise self._damage(".metadata", exc) from exc

        def read_data(self, plan: Any, planner: Any) -> Any:
            # Name the file torch was reading when its reader fails (it does not).
            opened: list[str] = []
            create = self.fs.create_stream

            @contextlib.contextmanager
            def create_stream(path: Any, mode: str) -> Iterator[Any]:
                opened.append(os.fspath(path))
                with create(path, mode) as stream:
                    yield stream

            self.fs.create_stream = create_stream
            try:
                return super().read_data(plan, planner)
            except Exception as exc:
                if not opened or not _i.is_read_error(exc):
                    raise
                raise self._damage(opened[-1].rsplit("/", 1)[-1], exc) from exc
            finally:
                del self.fs.create_stream

        def _damage(self, rel: str, exc: BaseException) -> DamagedCheckpointError:
            msg = _i.damaged_file(self.url, rel, exc, self._storage_options)
            self.damaged = DamagedCheckpointError(msg, url=self.url, file=rel)
            return self.damaged

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
    verify: bool = True,
    **reader_kwargs: Any,
) -> dict[str, Any]:
    """Load checkpoint ``url`` into ``state`` in place (``Stateful`` values get
    ``load_state_dict``); raises `IncompleteCheckpointError` for an unfinished one and
    `DamagedCheckpointError` for a damaged one: a file missing or of another size than its
    manifest records (checked first, with ``verify``: one listing), or one torch's reader
    fails on. Returns ``state``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from . import integrity as _i

    so = storage_options or {}
    reader = storage_classes()["VolumeReader"](url, **so, **reader_kwargs)
    if reader.require_complete and not is_complete(url, **so):
        # Checked here too so the error is not wrapped in torch's CheckpointException.
        raise IncompleteCheckpointError(
            f"{os.fspath(url)} is not a complete checkpoint (no {MARKER} marker: its save did "
            f"not finish). Use gangrun.checkpoint.latest() to find the last good one."
        )
    if verify and reader.require_complete:
        _i.check_before_load(os.fspath(url), so)
    try:
        with _quiet_single_process():
            dcp.load(state, storage_reader=reader, process_group=process_group, no_dist=_no_dist())
    except CheckpointException as exc:
        # Every rank gets every rank's failure: the lowest rank's damage, the same everywhere.
        failures = [f[0] if isinstance(f, tuple) else f for _, f in sorted(exc.failures.items())]
        damaged = [f for f in failures if isinstance(f, DamagedCheckpointError)]
        if damaged or reader.damaged is not None:
            raise (damaged or [reader.damaged])[0] from exc
        raise
    return state


from .integrity import CheckpointReport, Problem, newest_valid, scan, verify  # noqa: E402
