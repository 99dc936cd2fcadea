"""The checkpoint I/O: the storage writer and reader of ``torch.distributed.checkpoint`` on
any fsspec URL (`VolumeWriter`, `VolumeReader`), and the one place a checkpoint is written
(`write`, which ``gangrun.checkpoint.save`` and ``gangrun.Checkpointer`` both call) and read
(`read`, behind ``gangrun.checkpoint.load``).

Importing this module imports torch (its classes subclass torch's): ``gangrun.checkpoint``
reaches it on first use only (``checkpoint.VolumeWriter``, ``save``, ``load``), so importing
that package, or ``gangrun``, imports no torch.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .._compat_imports import TORCH_SUPPORTED, private_import
from . import (
    MARKER,
    DamagedCheckpointError,
    IncompleteCheckpointError,
    filesystem,
    is_complete,
    is_local,
)
from . import integrity as _i
from . import manifest as _v

if TYPE_CHECKING:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
else:
    # Not re-exported by torch: the guard names the supported torch versions if it moves.
    _PRIVATE = "torch.distributed.checkpoint._fsspec_filesystem"
    FsspecReader = private_import(_PRIVATE, "FsspecReader", supported=TORCH_SUPPORTED)
    FsspecWriter = private_import(_PRIVATE, "FsspecWriter", supported=TORCH_SUPPORTED)


class VolumeWriter(FsspecWriter):
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
            sync_files = is_local(fs)
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


class VolumeReader(FsspecReader):
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

        self.fs.create_stream = create_stream  # type: ignore[method-assign]  # this read only
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


def _no_dist() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized())


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    # torch warns on every single-process save/load; here that is the intended use.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def write(
    state: dict[str, Any],
    url: str | os.PathLike[str],
    *,
    process_group: Any = None,
    storage_options: dict[str, Any] | None = None,
    stager: Any = None,
    **writer_kwargs: Any,
) -> Any:
    """Write ``state`` to checkpoint ``url`` through a `VolumeWriter` (every rank calls it when
    a process group is initialised; rank 0 commits). Without ``stager``: saved on return
    (``None``). With one (a DCP ``AsyncStager``): the state is copied off the device and the
    upload runs in the background; returns the future of its completion."""
    import torch.distributed.checkpoint as dcp

    writer = VolumeWriter(url, **(storage_options or {}), **writer_kwargs)
    no_dist = _no_dist()
    if stager is not None:
        fut = dcp.async_save(
            state,
            storage_writer=writer,
            process_group=process_group,
            no_dist=no_dist,
            async_stager=stager,
        )
        return getattr(fut, "upload_completion", fut)
    with _quiet_single_process():
        dcp.save(state, storage_writer=writer, process_group=process_group, no_dist=no_dist)
    return None


def read(
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

    so = storage_options or {}
    reader = VolumeReader(url, **so, **reader_kwargs)
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
        first = damaged[0] if damaged else reader.damaged
        if first is not None:
            raise first from exc
        raise
    return state


__all__ = ["VolumeReader", "VolumeWriter", "read", "write"]
