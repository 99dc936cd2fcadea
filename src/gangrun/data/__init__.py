"""Stream files from any storage into training, sharded exactly across ranks and workers.

>>> from gangrun.data import VolumeDataset
>>> ds = VolumeDataset("s3://bucket/shards/", decode=torch.load, shuffle=True)
>>> loader = ds.loader(batch_size=32, num_workers=2)
>>> for epoch in range(start_epoch, epochs):
...     ds.set_epoch(epoch)
...     for batch in loader: ...

What it guarantees:

- the files under a local directory, a glob, or any fsspec URL are listed once and sorted, so
  every rank and every DataLoader worker sees the same list;
- each epoch every file is read exactly once, split across ranks (``RANK``/``WORLD_SIZE``) and
  across the DataLoader workers of each rank;
- every rank yields the same number of files per epoch: ``uneven="pad"`` (default) repeats a
  few files so that no file is skipped, ``uneven="drop"`` leaves out the last ``n % world_size``
  files of the epoch's order. When ``decode`` turns one file into several samples the counts
  are only equal if every file holds as many samples; pass ``samples_per_rank=N`` to make every
  rank yield exactly ``N`` samples whatever the files hold;
- ``set_epoch(e)`` reshuffles (``shuffle=True``) with a permutation that depends only on
  ``seed`` and ``e``;
- remote files (anything but the local filesystem) are cached on local disk, bounded by
  ``cache_limit`` bytes with least-recently-used eviction, filled atomically (temporary name,
  then rename) under a per-file lock, so ranks and workers that want the same file download it
  once; the cache is re-used across epochs, calls and processes;
- ``state_dict()``/``load_state_dict()`` record how far each rank got, so a restarted gang
  continues in the middle of an epoch (iterate the dataset directly or through
  `VolumeDataset.loader`; a plain ``DataLoader`` with workers cannot report progress).

``import gangrun`` does not import this module; importing it imports torch (the dataset is a
``torch.utils.data.IterableDataset``), fsspec is imported when files are listed.

Modules (every one importable on its own; only ``dataset``, ``loader`` and ``sampler`` import
torch):

- ``listing``: `FileEntry`, listing and sorting a source's files (fsspec), local reads;
- ``split``: what both datasets split alike: the rank and world size (strict), an epoch's
  order, the position record (pure);
- ``sharding``: a `VolumeDataset`'s epoch order, rank shares, worker plans (pure: no torch, no
  fsspec);
- ``cache``: `FileCache`, the node-local cache of remote files;
- ``prefetch``: reading a worker's files in order with misses fetched ahead;
- ``read_errors``: `DataReadError`, the error of a file that cannot be read, decoded or
  handed over, naming the file (and row group), the rank and the DataLoader worker;
- ``dataset``: [`VolumeDataset`][gangrun.data.VolumeDataset];
- ``loader``: `VolumeLoader`;
- ``table``: the package of `TableDataset`, batches of a Parquet or Delta Lake table:
  ``table.dataset`` (the dataset), ``table.loader`` (`TableLoader`),
  ``table.plan`` (the split arithmetic, pure), ``table.source`` (files, schema, row groups;
  pyarrow), ``table.delta`` (Delta snapshots; deltalake), ``table.convert`` (Arrow to tensors)
  and ``table.handover`` (the DataLoader workers' hand-over of batches). pyarrow and deltalake
  are imported only by these modules.
- ``sampler``: `DistributedSampler`, a drop-in for torch's with one global order per epoch,
  resumable at the same or another world size, `per_rank_batch` (the global batch held) and
  `micro_batches` (a rank's batch split for gradient accumulation);
- ``lanes``: the global batch held by `VolumeDataset`/`TableDataset` (``global_batch_size=``):
  an epoch cut into canonical lanes, whole lanes per rank (pure);
- ``elastic``: the rest of an epoch continued on another number of ranks (per-rank order).

The names below are loaded on first use, so ``import gangrun.data.sharding`` does not import
torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .cache import FileCache, default_cache_dir
    from .dataset import VolumeDataset
    from .listing import FileEntry
    from .loader import VolumeLoader
    from .read_errors import DataReadError
    from .sampler import DistributedSampler, micro_batches, per_rank_batch
    from .table.dataset import TableDataset
    from .table.loader import TableLoader
    from .table.source import TableError

_WHERE = {
    "VolumeDataset": "gangrun.data.dataset",
    "VolumeLoader": "gangrun.data.loader",
    "FileCache": "gangrun.data.cache",
    "default_cache_dir": "gangrun.data.cache",
    "FileEntry": "gangrun.data.listing",
    "TableDataset": "gangrun.data.table.dataset",
    "TableLoader": "gangrun.data.table.loader",
    "TableError": "gangrun.data.table.source",
    "DataReadError": "gangrun.data.read_errors",
    "DistributedSampler": "gangrun.data.sampler",
    "per_rank_batch": "gangrun.data.sampler",
    "micro_batches": "gangrun.data.sampler",
}

__all__ = [
    "VolumeDataset",
    "VolumeLoader",
    "TableDataset",
    "TableError",
    "TableLoader",
    "DataReadError",
    "FileCache",
    "FileEntry",
    "default_cache_dir",
    "DistributedSampler",
    "per_rank_batch",
    "micro_batches",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))
