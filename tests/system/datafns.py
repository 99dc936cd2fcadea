"""Rank functions for the data/checkpoint system tests (importable by reference in ranks)."""

from __future__ import annotations

import os
import signal
from typing import Any


def utf8(data: bytes) -> str:
    return data.decode()


def _init_gloo():
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return dist


def read_epoch(
    source: str,
    storage_options: dict,
    cache_dir: str,
    num_workers: int,
    epoch: int,
    seed: int = 3,
) -> dict[str, Any]:
    """Every sample this rank reads in ``epoch`` (through the loader), and cache counters."""
    from gangrun.data import VolumeDataset

    ds = VolumeDataset(
        source, storage_options=storage_options, cache_dir=cache_dir, shuffle=True, seed=seed
    )
    ds.set_epoch(epoch)
    got = [bytes(b) for b in ds.loader(batch_size=None, num_workers=num_workers)]
    return {"rank": int(os.environ["RANK"]), "samples": got}


def save_checkpoint(url: str, step: int, storage_options: dict, crash_rank: int = -1) -> str:
    """Both ranks save a DCP checkpoint; ``crash_rank`` is SIGKILLed after writing its data."""
    import torch

    from gangrun import checkpoint

    dist = _init_gloo()
    rank = dist.get_rank()
    state = {
        f"own{rank}": torch.full((3,), float(step * 10 + rank)),
        "shared": torch.arange(4.0) * step,
        "step": step,
    }
    if crash_rank < 0:
        checkpoint.save(state, url, storage_options=storage_options)
    else:
        import torch.distributed.checkpoint as dcp

        class Crashing(checkpoint.VolumeWriter):  # type: ignore[misc, valid-type]
            def write_data(self, plan, planner):
                fut = super().write_data(plan, planner)
                if rank == crash_rank:
                    os.kill(os.getpid(), signal.SIGKILL)  # dies with its data half written
                return fut

        dcp.save(state, storage_writer=Crashing(url, **storage_options))
    dist.barrier()
    dist.destroy_process_group()
    return url


def load_checkpoint(root: str, storage_options: dict) -> dict[str, Any]:
    import torch

    from gangrun import checkpoint

    dist = _init_gloo()
    rank = dist.get_rank()
    url = checkpoint.latest(root, **storage_options)
    assert url is not None
    state = {f"own{rank}": torch.zeros(3), "shared": torch.zeros(4), "step": -1}
    checkpoint.load(state, url, storage_options=storage_options)
    dist.barrier()
    dist.destroy_process_group()
    return {
        "url": url,
        "own": state[f"own{rank}"].tolist(),
        "shared": state["shared"].tolist(),
        "step": state["step"],
    }


def train_part(source: str, ckpt_root: str, batches: int, num_workers: int) -> dict[str, Any]:
    """Consume ``batches`` batches (resuming from the latest checkpoint), then checkpoint."""
    from gangrun import checkpoint
    from gangrun.data import VolumeDataset

    dist = _init_gloo()
    ds = VolumeDataset(source, shuffle=True, seed=11, decode=utf8)
    state: dict[str, Any] = {"data": ds, "step": 0}
    last = checkpoint.latest(ckpt_root)
    if last is not None:
        checkpoint.load(state, last)
    loader = ds.loader(batch_size=2, num_workers=num_workers)
    seen: list[str] = []
    for n, batch in enumerate(loader, 1):
        seen.extend(batch)
        state["step"] += 1
        if n == batches:
            break
    checkpoint.save(state, f"{ckpt_root}/step-{state['step']:04d}")
    dist.barrier()
    dist.destroy_process_group()
    return {"seen": seen, "step": state["step"]}
