"""The I/O of a `gangrun.Checkpointer`: one checkpoint of this rank's state, written (in the
background or not) and read back.

The split is Lightning's (``ModelCheckpoint`` decides when, ``CheckpointIO`` does the I/O):
`gangrun.rank.checkpointer` decides when to save, what goes in, which checkpoint to restore
and which to keep; `CheckpointIO` writes and reads. Its writes go through
`gangrun.checkpoint.volume.write`, the one place a checkpoint is written (``gangrun.checkpoint.
save`` calls it too); DeepSpeed engines write through their own checkpoint API, beside it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ..checkpoint import state as _state


def local(url: str) -> str:
    """``url`` as a path of this machine (a ``file://`` URL's path; other URLs as they are)."""
    return url[len("file://") :] if url.startswith("file://") else url


class CheckpointIO:
    """Writes and reads checkpoints of one manager's state (``storage_options``: fsspec's;
    ``async_save``: write in the background, the caller waiting only for the copy of the
    state off the device)."""

    def __init__(self, storage_options: dict[str, Any], async_save: bool) -> None:
        self.storage_options = storage_options
        self.async_save = async_save
        self._pending: tuple[Any, int, str] | None = None  # (future, step, url)
        self._stager: Any = None

    def write(self, e: _state.Entries, sd: dict[str, Any], url: str, step: int, group: Any) -> bool:
        """Write the save dict ``sd`` (and ``e``'s DeepSpeed engines) as checkpoint ``url`` of
        ``step``. Returns True when it is committed on return, False when it is written in
        the background (`wait` commits it). The save before must have been waited for."""
        assert self._pending is None, "the save in flight was not waited for"
        from ..checkpoint import volume

        for key, engine in e.engines.items():
            engine.save_checkpoint(
                os.path.join(local(url), "deepspeed", key), tag="engine", save_latest=False
            )
        so = self.storage_options
        if self.async_save and not e.engines:  # DeepSpeed engines are saved synchronously
            fut = volume.write(
                sd, url, process_group=group, storage_options=so, stager=self._get_stager()
            )
            self._pending = (fut, step, url)
            return False
        volume.write(sd, url, process_group=group, storage_options=so)
        return True

    def _get_stager(self) -> Any:
        # One stager for the manager's life: its CPU copy of the state is reused from one
        # save to the next (no fresh allocation, pinned memory on GPUs); the previous save
        # has always finished with it (the manager waits first).
        if self._stager is None:
            import torch
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            pinned = torch.cuda.is_available()
            self._stager = DefaultStager(StagingOptions(pinned, False, False, False))
        return self._stager

    def done(self) -> bool:
        """A background save is in flight and has finished (`wait` returns at once)."""
        return self._pending is not None and self._pending[0].done()

    def wait(self) -> tuple[int, str] | None:
        """Block until the save in flight (if any) is written; its ``(step, url)``, or None
        when there was none. Raises what the save raised."""
        if self._pending is None:
            return None
        fut, step, url = self._pending
        self._pending = None
        fut.result()
        return step, url

    def read(
        self,
        e: _state.Entries,
        url: str,
        rank: int,
        saved: int | None,
        group: Any,
        state: Mapping[str, Any],
    ) -> dict[str, Any]:
        """Load checkpoint ``url`` (saved by ``saved`` ranks; None: as many as now) into
        ``state``; returns the manager's own record saved with it (the step, the metrics)."""
        from ..checkpoint import volume

        for key, engine in e.engines.items():
            path, _ = engine.load_checkpoint(
                os.path.join(local(url), "deepspeed", key), tag="engine"
            )
            if path is None:
                raise RuntimeError(f"DeepSpeed found no checkpoint for {key!r} in {url}")
        tpl = _state.load_template(e, rank, saved)
        volume.read(tpl, url, process_group=group, storage_options=self.storage_options)
        return _state.apply(e, tpl, rank, state, saved=saved)

    def close(self) -> None:
        """Free the staging copy of the state (the save in flight waited for first)."""
        if self._stager is not None:
            self._stager.close()
            self._stager = None


__all__ = ["CheckpointIO", "local"]
