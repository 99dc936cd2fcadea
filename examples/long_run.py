"""A long run that survives a preemption: gangrun.Checkpointer with DDP or FSDP2.

Trains once without interruption, then again with a preemption halfway
(``handle.cancel(checkpoint=True)``: every rank saves the same step and stops), resumes, and
checks the resumed run ends on the same parameters (docs/long_runs.md).

    python examples/long_run.py                      # every GPU, else 2 CPU ranks
    python examples/long_run.py --framework fsdp2 --ckpt /tmp/long-run
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
from torch import nn

import gangrun

STEPS = 40


@gangrun.distributed(processes=2, grace_period=60)
def train(framework: str, slow: float = 0.0) -> dict:
    import torch.distributed as dist

    device = gangrun.device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(gangrun.backend())
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)).to(device)
    if framework == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        model: nn.Module = fully_shard(net)
    else:
        model = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, STEPS)
    torch.manual_seed(1 + dist.get_rank())  # each rank its own data stream (restored too)
    ckpt = gangrun.Checkpointer({"model": model, "optim": opt, "sched": sched}, every=5)
    for step in ckpt.steps(STEPS):
        x = torch.randn(16, 32, device=device)
        loss = (model(x) - x.sum(1, keepdim=True).tanh()).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        ckpt.log_metrics({"loss": loss.item()}, step)  # rank 0's values, once per step
        time.sleep(slow)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    params = {k: v.detach().cpu().clone() for k, v in full.items()}
    dist.destroy_process_group()
    return {"start": ckpt.restored_from, "params": params}


def _main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--framework", choices=("ddp", "fsdp2"), default="ddp")
    p.add_argument("--ckpt", help="checkpoint root (default: a temporary directory)")
    p.add_argument("--no-mlflow", action="store_true")
    a = p.parse_args()
    root = a.ckpt or tempfile.mkdtemp(prefix="long-run-")
    fn = train.options(mlflow=not a.no_mlflow)
    fn = fn.options(gpus=None) if gangrun.accelerators() else fn.options(processes=2)
    base = fn.options(checkpoint_dir=os.path.join(root, "base")).distributed(a.framework)
    handle = fn.options(checkpoint_dir=os.path.join(root, "run")).submit(a.framework, 0.05)
    time.sleep(3.0)  # somewhere mid-training (or not yet started: then it stops at step 1)
    handle.cancel(checkpoint=True, wait=0)
    try:
        handle.result()
        print("the run finished before the preemption landed")
    except gangrun.DistributedPreemptedError as err:
        print(f"preempted: {err}")
    again = fn.options(checkpoint_dir=os.path.join(root, "run")).distributed(a.framework)
    worst = max(
        float((again[0]["params"][k] - v).abs().max()) for k, v in base[0]["params"].items()
    )
    print(f"{len(base)} ranks, {a.framework}: resumed from {again[0]['start']}, max diff {worst}")
    assert worst <= (0.0 if not gangrun.accelerators() else 1e-6), "the resumed run ended elsewhere"
    print("OK")


if __name__ == "__main__":
    _main()
