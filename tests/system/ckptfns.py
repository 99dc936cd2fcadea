"""Rank functions for the long-run system tests (tests/system/test_long_runs.py).

One small training loop for DDP, FSDP2 and DeepSpeed ZeRO: a shuffled VolumeLoader over real
files, Adam, an LR scheduler, noise from Python's, NumPy's and torch's RNGs (so each must be
restored exactly), the loss logged through the Checkpointer. Hooks interrupt it: SIGKILL a
rank at a step (once, by a marker file), or block every rank at a step until a file appears.
"""

from __future__ import annotations

import os
import random
import signal
import time
from typing import Any

DIM = 8


def write_data(root: str, n: int = 12) -> None:
    """``n`` files of 2 samples each (``DIM`` inputs + 1 target, float32)."""
    import numpy as np

    os.makedirs(root, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(n):
        x = rng.standard_normal((2, DIM + 1)).astype("float32")
        with open(os.path.join(root, f"f{i:02d}.bin"), "wb") as f:
            f.write(x.tobytes())


def _decode(raw: bytes) -> Any:
    import torch

    return torch.frombuffer(bytearray(raw), dtype=torch.float32).reshape(2, DIM + 1)


def _model(framework: str, rank: int) -> tuple[Any, Any, Any, dict[str, Any]]:
    import torch
    from torch import nn

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(DIM, 16), nn.Tanh(), nn.Linear(16, 1))
    if framework == "deepspeed":
        import deepspeed

        cfg = {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 1,
            "optimizer": {"type": "Adam", "params": {"lr": 0.02, "torch_adam": True}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4}},
            "zero_optimization": {"stage": 2},
            "steps_per_print": 10**9,
        }
        engine, _, _, _ = deepspeed.initialize(
            model=net, model_parameters=net.parameters(), config=cfg
        )
        return engine, None, None, {"engine": engine}
    if framework == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model: Any = DistributedDataParallel(net)
    else:  # fsdp2
        from torch.distributed.fsdp import fully_shard

        for layer in net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        model = fully_shard(net)
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.8)
    return model, opt, sched, {"model": model, "optim": opt, "sched": sched}


def _full_params(framework: str, model: Any) -> dict[str, Any]:
    if framework == "deepspeed":
        return {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in sd.items()}


def train(
    framework: str,
    data: str,
    total: int = 10,
    every: int = 3,
    storage_options: dict | None = None,
    kill_at: int | None = None,
    marker: str | None = None,
    block_at: int | None = None,
    gate: str | None = None,
    workers: int = 0,
) -> dict[str, Any]:
    import numpy as np
    import torch
    import torch.distributed as dist

    import gangrun
    from gangrun.data import VolumeDataset, VolumeLoader

    if framework == "deepspeed":
        from gangrun.compat.frameworks import deepspeed_setup

        deepspeed_setup()
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    random.seed(100 + rank)
    np.random.seed(200 + rank)
    model, opt, _sched, state = _model(framework, rank)
    torch.manual_seed(300 + rank)
    ds = VolumeDataset(data, shuffle=True, seed=5, decode=_decode)
    loader = VolumeLoader(ds, batch_size=None, num_workers=workers, persistent_workers=workers > 0)
    state["loader"] = loader
    state["extra"] = {"seen": 0}
    ckpt = gangrun.Checkpointer(state, every=every, keep=2, storage_options=storage_options)
    start = ckpt.restore()
    it = iter(loader)
    losses = {}
    for step in ckpt.steps(total):
        try:
            batch = next(it)
        except StopIteration:
            ds.set_epoch(ds.epoch + 1)
            it = iter(loader)
            batch = next(it)
        noise = torch.randn(2, DIM) * 0.01 + float(np.random.rand()) * 1e-3 + random.random() * 1e-3
        x, y = batch[:, :DIM] + noise, batch[:, DIM:]
        if framework == "deepspeed":
            loss = torch.nn.functional.mse_loss(model(x), y)
            model.backward(loss)
            model.step()
        else:
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            _sched.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses[step] = mean.item() / world
        if rank == 0:
            ckpt.log_metrics({"loss": losses[step]}, step)
        if kill_at == step and rank == 1 and marker and not os.path.exists(marker):
            open(marker, "w").close()
            ckpt.wait()  # the async save in flight commits first: the restart resumes from it
            os.kill(os.getpid(), signal.SIGKILL)
        if block_at == step and gate:
            open(f"{gate}.reached.{rank}", "w").close()
            deadline = time.monotonic() + 60
            while not os.path.exists(gate) and time.monotonic() < deadline:
                time.sleep(0.02)
    params = _full_params(framework, model)
    dist.barrier()
    return {
        "rank": rank,
        "start": start,
        "losses": losses,
        "params": params,
        "restored_from": ckpt.restored_from,
    }
