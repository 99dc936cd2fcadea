"""Rank functions of bench_tables.py (importable by reference inside ranks)."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from typing import Any


def _dist() -> Any:
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return dist


def cpu_seconds() -> float:
    """CPU seconds of this process and its children (DataLoader workers): those reaped,
    and those alive (persistent workers)."""
    import resource

    import psutil

    a = resource.getrusage(resource.RUSAGE_SELF)
    b = resource.getrusage(resource.RUSAGE_CHILDREN)
    live = 0.0
    for child in psutil.Process().children(recursive=True):
        try:
            t = child.cpu_times()
        except psutil.Error:  # ended since: reaped, its time is in RUSAGE_CHILDREN
            continue
        live += t.user + t.system
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime + live


def _count(loader: Any, lists: bool = False) -> int:
    """Rows of an epoch; ``lists``: Hugging Face's Arrow batches (one row of list columns)."""
    n = 0
    if lists:
        import pyarrow.compute as pc

        for batch in loader:
            n += pc.sum(pc.list_value_length(batch.column("id"))).as_py()
        return n
    for batch in loader:
        n += batch.num_rows if hasattr(batch, "num_rows") else len(batch["id"])
    return n


def _timed_epochs(
    epochs: int, setup: float, prepare: Callable[[int], Any], run: Callable[[Any], int]
) -> dict[str, Any]:
    """Per epoch (the ranks start each together): ``prepare(epoch)`` untimed, then the wall
    and CPU seconds of ``run(prepared)`` (which returns the rows it read) and of dropping
    what ``prepare`` made."""
    dist = _dist()
    times: list[float] = []
    cpu: list[float] = []
    rows = 0
    for epoch in range(epochs):
        dist.barrier()
        prepared = prepare(epoch)
        t, c = time.perf_counter(), cpu_seconds()
        rows = run(prepared)
        del prepared  # a loader made there is gone: its workers joined, their CPU counted
        times.append(time.perf_counter() - t)
        cpu.append(cpu_seconds() - c)
    dist.barrier()
    dist.destroy_process_group()
    return {"times": times, "cpu": cpu, "rows": rows, "setup": setup}


def table_epochs(
    source: str,
    opts: dict,
    cache_dir: str,
    workers: int,
    batch_size: int,
    output: str,
    epochs: int,
    cold: bool,
    persistent: bool = True,
) -> dict[str, Any]:
    """Seconds of each TableDataset epoch on this rank (ranks start each epoch together;
    ``cold``: rank 0 empties the node cache before every epoch). ``persistent``: one
    ``ds.loader()`` for all epochs (its default: workers kept across epochs); else a loader
    with ``persistent_workers=False`` made for each epoch (workers forked every epoch)."""
    from gangrun.data import TableDataset

    dist = _dist()
    t = time.perf_counter()
    ds = TableDataset(
        source, storage_options=opts, cache_dir=cache_dir, batch_size=batch_size, output=output
    )
    setup = time.perf_counter() - t

    def prepare(epoch: int) -> None:
        if cold and dist.get_rank() == 0:
            shutil.rmtree(cache_dir, ignore_errors=True)
            os.sync()
        dist.barrier()
        ds.set_epoch(epoch)

    kept: list[Any] = []

    def run(_: None) -> int:
        if persistent:
            if not kept:
                kept.append(ds.loader(num_workers=workers))
            return _count(kept[0])
        loader = ds.loader(num_workers=workers, persistent_workers=False)
        rows = _count(loader)
        del loader  # workers joined: their CPU time is counted
        return rows

    return _timed_epochs(epochs, setup, prepare, run)


def hf_epochs(
    files: list[str], workers: int, batch_size: int, epochs: int, fmt: str
) -> dict[str, Any]:
    """The same with Hugging Face ``datasets`` streaming the files, ``split_dataset_by_node``,
    ``.with_format(fmt).batch(batch_size)`` through one DataLoader with ``workers``
    persistent workers for all epochs (``datasets`` shares its epoch with them; ``fmt=
    "numpy"``: batches become dicts of tensors, as TableDataset's; ``"arrow"``: its fastest
    path, each batch one Arrow row of list columns)."""
    import torch
    from datasets import load_dataset
    from datasets.distributed import split_dataset_by_node

    dist = _dist()
    t = time.perf_counter()
    ds = load_dataset("parquet", data_files=files, streaming=True, split="train")
    ds = split_dataset_by_node(ds, rank=dist.get_rank(), world_size=dist.get_world_size())
    setup = time.perf_counter() - t

    batched = ds.with_format(fmt).batch(batch_size)
    loader = torch.utils.data.DataLoader(
        batched, batch_size=None, num_workers=workers, persistent_workers=workers > 0
    )

    def prepare(epoch: int) -> None:
        batched.set_epoch(epoch)

    def run(_: None) -> int:
        return _count(loader, lists=fmt == "arrow")

    return _timed_epochs(epochs, setup, prepare, run)
