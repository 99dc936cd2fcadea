"""Rank function for the elastic-resume system tests (tests/system/test_elastic.py).

The seed's classic loop: ``DataLoader(TensorDataset, batch_size=per_rank,
sampler=DistributedSampler(ds))`` with gangrun's sampler, a deterministic model (no dropout),
DDP or FSDP2, Adam, the global batch held (``per_rank_batch``). The function stops after
``total`` steps (a save there): a later call with more steps, on any number of ranks,
continues it.
"""

from __future__ import annotations

from typing import Any

N, DIM, GLOBAL_BATCH, EPOCHS, SEED = 24, 4, 6, 2, 7  # 4 global batches per epoch


def _dataset() -> Any:
    import torch
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, DIM, generator=g)
    y = x.sum(1, keepdim=True).sin() + 0.1 * torch.randn(N, 1, generator=g)
    return TensorDataset(torch.arange(N), x, y)


def _model(framework: str) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(DIM, 8), nn.Tanh(), nn.Linear(8, 1))
    if framework == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(net)
    from torch.distributed.fsdp import fully_shard

    for layer in net:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    return fully_shard(net)


def _full(model: Any, opt: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The whole (unsharded) model and optimizer state, on every rank."""
    import torch
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    from torch.utils._pytree import tree_map

    def copy(v: Any) -> Any:  # the state dicts share storage with the live parameters
        return v.detach().clone() if isinstance(v, torch.Tensor) else v

    full = StateDictOptions(full_state_dict=True)
    return tree_map(copy, get_model_state_dict(model, options=full)), tree_map(
        copy, get_optimizer_state_dict(model, opt, options=full)
    )


def _finish(ckpt: Any, model: Any, opt: Any, rank: int, restored: Any) -> dict[str, Any]:
    """The end of a run: the last save, every rank's; rank 0's full model and optimizer now
    and after the restore (``restored``)."""
    import torch.distributed as dist

    ckpt.save()
    ckpt.close()
    model_sd, optim_sd = _full(model, opt)
    dist.barrier()
    mine = rank == 0
    return {
        "rank": rank,
        "model": model_sd if mine else None,
        "optim": optim_sd if mine else None,
        "restored": restored if mine else None,
    }


def train(
    framework: str, total: int, pause: float = 0.0, every: int | None = None
) -> dict[str, Any]:
    import time

    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    import gangrun
    from gangrun.data import DistributedSampler, per_rank_batch

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ds = _dataset()
    sampler = DistributedSampler(ds, seed=SEED)
    loader = DataLoader(ds, batch_size=per_rank_batch(GLOBAL_BATCH), sampler=sampler)
    model = _model(framework)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    state = {"model": model, "optim": opt, "loader": loader, "epoch": 0}
    ckpt = gangrun.Checkpointer(state, keep=2, async_save=False, every=every)
    start = step = ckpt.restore()
    restored = _full(model, opt) if start else None
    reads: dict[int, list[int]] = {}
    losses: dict[int, float] = {}
    while state["epoch"] < EPOCHS and step < total:
        epoch = state["epoch"]
        sampler.set_epoch(epoch)
        for ids, x, y in loader:
            reads.setdefault(epoch, []).extend(ids.tolist())
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)  # the ranks' shares are equal: the global batch's mean
            losses[step] = mean.item() / world
            ckpt.step_done(step, total)
            step += 1
            time.sleep(pause)
            if step >= total:
                break
        else:
            state["epoch"] = epoch + 1
    out = _finish(ckpt, model, opt, rank, restored)
    return {**out, "world": world, "start": start, "reads": reads, "losses": losses}


def train_data(kind: str, root: str, epochs: int, total: int, workers: int) -> dict[str, Any]:
    """DDP over a `TableDataset` (``kind="table"``, an ``id`` column) or a `VolumeDataset`
    (``"volume"``, JSON files of ids) loader: ``epochs`` epochs, stopping after ``total``
    steps (a save there). Returns the ids each epoch read on this rank, the step it started
    at, and (rank 0) the full model and optimizer after the restore and at the end."""

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import gangrun
    from gangrun.data import TableDataset, VolumeDataset

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if kind == "table":
        ds: Any = TableDataset(root, batch_size=5, shuffle=True, seed=SEED, shuffle_buffer=37)
        loader = ds.loader(num_workers=workers)
    else:
        ds = VolumeDataset(root, shuffle=True, seed=SEED, decode=json_ids)
        loader = ds.loader(batch_size=3, num_workers=workers)
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(1, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    state = {"model": model, "optim": opt, "loader": loader, "epoch": 0}
    ckpt = gangrun.Checkpointer(state, keep=2, async_save=False)
    start = step = ckpt.restore()
    restored = _full(model, opt) if start else None
    reads: dict[int, list[int]] = {}
    while state["epoch"] < epochs and step < total:
        epoch = state["epoch"]
        ds.set_epoch(epoch)
        for batch in loader:
            ids = batch["id"] if isinstance(batch, dict) else batch
            ids = torch.as_tensor(ids).flatten()
            reads.setdefault(epoch, []).extend(int(i) for i in ids.tolist())
            x = ids.to(torch.float32).unsqueeze(1) / 100.0
            loss = (model(x) - x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            ckpt.step_done(step, total)
            step += 1
            if step >= total:
                break
        else:
            state["epoch"] = epoch + 1
    return {**_finish(ckpt, model, opt, rank, restored), "start": start, "reads": reads}


def json_ids(raw: bytes) -> Any:
    """A volume file's sample: the id it holds."""
    import json

    return json.loads(raw)


HELD = {"table": (12, 6), "volume": (6, 6)}  # (global batch, lanes): 1, 2, 3 and 6 ranks


def held_dataset(kind: str, root: str, rank: int | None = None, world: int | None = None) -> Any:
    """A `TableDataset` (an ``id`` column) or `VolumeDataset` (JSON files of ids) with the
    global batch held."""
    from gangrun.data import TableDataset, VolumeDataset

    g, lanes = HELD[kind]
    if kind == "table":
        return TableDataset(
            root,
            global_batch_size=g,
            lanes=lanes,
            shuffle=True,
            seed=SEED,
            shuffle_buffer=7,
            rank=rank,
            world_size=world,
        )
    return VolumeDataset(
        root,
        global_batch_size=g,
        lanes=lanes,
        shuffle=True,
        seed=SEED,
        decode=json_ids,
        rank=rank,
        world_size=world,
    )


def features(ids: Any) -> tuple[Any, Any]:
    """A sample's input and target from its id alone (the same on every rank and world)."""
    import torch

    t = ids.to(torch.float64).unsqueeze(1)
    x = torch.sin(t * torch.arange(1, DIM + 1, dtype=torch.float64) / 7.0).to(torch.float32)
    return x, x.sum(1, keepdim=True).sin()


def train_held(kind: str, root: str, epochs: int, total: int, workers: int) -> dict[str, Any]:
    """DDP over a loader of `held_dataset`: the deterministic model of `train`, Adam, each
    step's loss the global batch's mean; stops after ``total`` steps (a save there)."""
    import torch
    import torch.distributed as dist

    import gangrun

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ds = held_dataset(kind, root)
    loader = ds.loader(num_workers=workers)
    model = _model("ddp")
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    state = {"model": model, "optim": opt, "loader": loader, "epoch": 0}
    ckpt = gangrun.Checkpointer(state, keep=2, async_save=False)
    start = step = ckpt.restore()
    restored = _full(model, opt) if start else None
    reads: dict[int, list[int]] = {}
    losses: dict[int, float] = {}
    while state["epoch"] < epochs and step < total:
        epoch = state["epoch"]
        ds.set_epoch(epoch)
        for batch in loader:
            ids = torch.as_tensor(batch["id"] if isinstance(batch, dict) else batch).flatten()
            reads.setdefault(epoch, []).extend(int(i) for i in ids.tolist())
            x, y = features(ids)
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)  # equal shares: the global batch's mean
            losses[step] = mean.item() / world
            ckpt.step_done(step, total)
            step += 1
            if step >= total:
                break
        else:
            state["epoch"] = epoch + 1
    out = _finish(ckpt, model, opt, rank, restored)
    return {**out, "world": world, "start": start, "reads": reads, "losses": losses}
