"""The DDP training script timed under torchrun and under gangrun (same code, same threads).

``torchrun --standalone --nproc_per_node=2 bench/ddp_train.py STEPS`` prints ``RESULT {json}``
from rank 0; gangrun runs :func:`train` on every rank.
"""

from __future__ import annotations

import json
import os
import sys
import time


def train(steps: int = 60, warmup: int = 10, batch: int = 64, width: int = 1024) -> dict:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(batch, width)
    y = torch.randn(batch, width)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()

    for _ in range(warmup):
        step()
    dist.barrier()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    dist.barrier()
    elapsed = time.perf_counter() - t
    out = {
        "steps_per_s": steps / elapsed,
        "threads": torch.get_num_threads(),
        "omp": os.environ.get("OMP_NUM_THREADS"),
        "rank": dist.get_rank(),
    }
    dist.destroy_process_group()
    return out


if __name__ == "__main__":
    res = train(int(sys.argv[1]) if len(sys.argv) > 1 else 60)
    if res["rank"] == 0:
        print("RESULT " + json.dumps(res), flush=True)
