"""Rank functions for the table system tests (importable by reference in ranks)."""

from __future__ import annotations

import json
import os
from typing import Any


def _dataset(source: str, opts: dict, cache_dir: str, **kw: Any) -> Any:
    from gangrun.data import TableDataset

    return TableDataset(
        source,
        storage_options=opts,
        cache_dir=cache_dir,
        shuffle=True,
        seed=7,
        batch_size=128,
        shuffle_buffer=512,
        columns=["id", "x"],
        **kw,
    )


def _ids(loader: Any, limit: int | None = None) -> list[list[int]]:
    out = []
    for n, batch in enumerate(loader, 1):
        assert batch["x"].dtype.is_floating_point
        out.append(batch["id"].tolist())
        if n == limit:
            break
    return out


def _flat(batches: list[list[int]]) -> list[int]:
    return [i for b in batches for i in b]


def epochs(source: str, opts: dict, cache_dir: str, workers: list[int]) -> dict[str, Any]:
    """For each worker count: the batches (ids) of epochs 0 and 1 through one loader (its
    workers kept across the epochs), and a resume of epoch 1 after 5 batches (state_dict
    through JSON, into a fresh dataset)."""
    out: dict[str, Any] = {"rank": int(os.environ["RANK"])}
    for nw in workers:
        ds = _dataset(source, opts, cache_dir)
        got: dict[str, Any] = {"len": len(ds)}
        loader = ds.loader(num_workers=nw)
        for epoch in (0, 1):
            ds.set_epoch(epoch)
            got[f"e{epoch}"] = _ids(loader)
        del loader
        part = _dataset(source, opts, cache_dir)
        part.set_epoch(1)
        got["head"] = _ids(part.loader(num_workers=nw), limit=5)
        state = json.loads(json.dumps(part.state_dict()))
        again = _dataset(source, opts, cache_dir)
        again.load_state_dict(state)
        got["rest"] = _ids(again.loader(num_workers=nw))
        out[str(nw)] = got
        out["keys"] = sorted(ds.file_access.key(e) for e in ds.table.files)  # its cache entries
    if out and ds.table.kind == "delta":  # time travel: the first version, without `extra`
        v0 = _dataset(source, opts, cache_dir, version=0)
        out["v0"] = sorted(_flat(_ids(v0.loader(num_workers=2))))
    return out


def train_part(
    source: str, opts: dict, cache_dir: str, ckpt_root: str, batches: int, nw: int
) -> dict[str, Any]:
    """Consume ``batches`` batches of epoch 1 (resuming from the latest checkpoint), then
    checkpoint the loader's position with gangrun.checkpoint."""
    import torch.distributed as dist

    from gangrun import checkpoint

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    ds = _dataset(source, opts, cache_dir)
    ds.set_epoch(1)
    state: dict[str, Any] = {"data": ds, "step": 0}
    last = checkpoint.latest(ckpt_root)
    if last is not None:
        checkpoint.load(state, last)
    seen = _ids(ds.loader(num_workers=nw), limit=batches)
    state["step"] += len(seen)
    checkpoint.save(state, f"{ckpt_root}/step-{state['step']:04d}")
    dist.barrier()
    dist.destroy_process_group()
    return {"seen": seen, "step": state["step"]}


def read_all(source: str, cache_dir: str, nw: int) -> int:
    """The rows of the rank's share of one epoch, through a loader with ``nw`` workers."""
    from gangrun.data import TableDataset

    ds = TableDataset(source, cache_dir=cache_dir, batch_size=128)
    return sum(len(batch["id"]) for batch in ds.loader(num_workers=nw))
