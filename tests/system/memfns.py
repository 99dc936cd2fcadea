"""Rank functions for the memory snapshot system tests (tests/system/test_memory_snapshots.py).

A DDP MLP on gloo ranks over a `gangrun.data.DistributedSampler` loader, the loop of
docs/long_runs.md (``step_done`` after each step, the epoch in the state), every step's
sample indices recorded. Hooks: rank ``kill_rank`` SIGKILLs itself inside step ``kill_at`` (``-1``: every rank, each by its own marker)
(after the update, before ``step_done``: that step is lost), once, by a marker file (with
``damage``, it first truncates the data files of every storage checkpoint under it); rank 0
SIGKILLs the snapshot keeper after step ``kill_keeper_at``; rank 0 raises in step
``raise_at``; every rank waits in step ``block_at`` for the file ``gate`` (``gate.reached.R``
once there); with ``die_after_restore`` (a marker file) rank 0 SIGKILLs itself once right
after a restore that resumed a step.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

N, DIM, BATCH = 40, 6, 2


def train(
    total: int,
    every: int = 100,
    kill_at: int | None = None,
    kill_rank: int = 1,
    marker: str | None = None,
    kill_keeper_at: int | None = None,
    block_at: int | None = None,
    gate: str | None = None,
    raise_at: int | None = None,
    damage: str | None = None,
    die_after_restore: str | None = None,
) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, TensorDataset

    import gangrun
    from gangrun.data import DistributedSampler
    from gangrun.wire import contract

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(
        nn.Sequential(nn.Linear(DIM, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 1))
    )
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.9)
    g = torch.Generator().manual_seed(1)
    data = torch.randn(N, DIM + 1, generator=g)
    ds = TensorDataset(data, torch.arange(N))
    sampler = DistributedSampler(ds, seed=3)
    # its own generator: each iter() draws a base seed from it, not from the global RNG
    # (which a restore puts back as it was at the step, before the loop's next iter())
    loader = DataLoader(
        ds, batch_size=BATCH, sampler=sampler, generator=torch.Generator().manual_seed(7)
    )
    torch.manual_seed(100 + rank)  # each rank's dropout stream
    state = {"model": model, "optim": opt, "sched": sched, "loader": loader, "epoch": 0}
    ckpt = gangrun.Checkpointer(state, every=every, keep=2)
    step = start = ckpt.restore()
    if die_after_restore and start and rank == 0 and not os.path.exists(die_after_restore):
        open(die_after_restore, "w").close()  # a second death: during the restart's restore
        os.kill(os.getpid(), signal.SIGKILL)
    seen: dict[int, list[int]] = {}
    losses: dict[int, float] = {}
    while step < total:
        sampler.set_epoch(state["epoch"])
        for batch, idx in loader:
            loss = nn.functional.mse_loss(model(batch[:, :DIM]), batch[:, DIM:])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            seen[step] = idx.tolist()
            losses[step] = loss.item()
            mine = f"{marker}.{rank}" if kill_rank < 0 and marker else marker
            if step == kill_at and kill_rank in (rank, -1) and mine and not os.path.exists(mine):
                if damage:  # every storage checkpoint's data truncated first
                    ckpt.wait()
                    for d, _, files in os.walk(damage):
                        for name in files:
                            if name.endswith(".distcp"):
                                os.truncate(os.path.join(d, name), 1)
                open(mine, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
            if step == kill_keeper_at and rank == 0:
                root = os.environ[contract.MEMORY_DIR]
                with open(os.path.join(root, ".keeper")) as f:
                    os.kill(int(f.read()), signal.SIGKILL)
            if step == raise_at and rank == 0:
                raise ValueError(f"failing at step {step} as asked")
            if step == block_at and gate:
                open(f"{gate}.reached.{rank}", "w").close()
                deadline = time.monotonic() + 60
                while not os.path.exists(gate) and time.monotonic() < deadline:
                    time.sleep(0.02)
            ckpt.step_done(step, total)
            step += 1
            if step >= total:
                break
        else:
            state["epoch"] += 1
    ckpt.close()
    params = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    dist.barrier()
    return {
        "start": start,
        "seen": seen,
        "losses": losses,
        "params": params,
        "restored_from": ckpt.restored_from,
    }
