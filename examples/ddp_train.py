"""DistributedDataParallel under gangrun.

The function below is ordinary DDP code: it runs once per rank, reads the torchrun
environment that gangrun sets, and works unchanged on CPU (gloo) and GPUs (nccl); only the
device and backend come from ``gangrun.device()`` / ``gangrun.backend()``.

    python examples/ddp_train.py                 # every GPU of this node, else 2 CPU ranks
    python examples/ddp_train.py --processes 2   # 2 CPU ranks (gloo)
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gangrun
from gangrun import distributed


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def make_data(rank: int, world: int, n: int = 512, seed: int = 0):
    """A fixed regression problem; each rank takes its own slice of it."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    y = torch.tanh(x @ torch.randn(16, 4, generator=g)) + 0.05 * torch.randn(n, 4, generator=g)
    return x[rank::world], y[rank::world]


@distributed(processes=2)
def train(steps: int = 30, lr: float = 0.01, seed: int = 0) -> dict:
    device = gangrun.device()  # cuda:LOCAL_RANK on a GPU node, cpu otherwise
    if device.type == "cuda":
        torch.cuda.set_device(device)  # so nccl uses this rank's GPU
    dist.init_process_group(gangrun.backend())  # reads RANK, WORLD_SIZE, MASTER_ADDR/PORT
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(seed)  # same init everywhere (DDP broadcasts rank 0's weights anyway)
        model = DDP(make_model().to(device))
        opt = torch.optim.Adam(model.parameters(), lr=lr)
        x, y = (t.to(device) for t in make_data(rank, world))

        losses = []
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            loss = F.mse_loss(model(x), y)
            loss.backward()  # DDP all-reduces the gradients here
            opt.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)  # the global loss, for reporting
            losses.append(mean.item() / world)
        if rank == 0:
            print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} after {steps} steps")
        params = {k: v.detach().cpu() for k, v in model.module.state_dict().items()}
        return {"rank": rank, "losses": losses, "params": params}
    finally:
        dist.destroy_process_group()


def _main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--processes", type=int, help="CPU ranks (default: every GPU, else 2)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--no-mlflow", action="store_true")
    a = p.parse_args()
    fn = train.options(mlflow=not a.no_mlflow)
    if a.processes is not None:
        fn = fn.options(processes=a.processes)
    elif gangrun.accelerators():
        fn = fn.options(gpus=None)  # every GPU of this node
    else:
        fn = fn.options(processes=2)
    out = fn.distributed(steps=a.steps)
    losses = out[0]["losses"]
    print(f"{len(out)} ranks, loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    assert losses[-1] < losses[0], "loss did not decrease"
    for r in out[1:]:
        for k, v in r["params"].items():
            assert torch.equal(v, out[0]["params"][k]), f"rank {r['rank']} differs on {k}"
    print("OK")


if __name__ == "__main__":
    _main()
