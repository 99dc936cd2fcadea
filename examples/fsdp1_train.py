"""FSDP1 (the ``FullyShardedDataParallel`` wrapper) under gangrun, with a sharded DCP checkpoint.

The older wrapper API still in wide use. Two things differ from FSDP2 on CPU: the wrapper
needs ``device_id=torch.device("cpu")`` (with ``None`` it refuses to run without an
accelerator), and loading its checkpoint uses ``allow_partial_load=True`` (see ``load``).

    python examples/fsdp1_train.py                      # every GPU, else 2 CPU ranks
    python examples/fsdp1_train.py --ckpt /tmp/fsdp1    # train, save, then resume in a 2nd call
"""

from __future__ import annotations

import argparse
import os
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

import gangrun
from gangrun import distributed


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def make_data(rank: int, world: int, n: int = 512, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    y = torch.tanh(x @ torch.randn(16, 4, generator=g)) + 0.05 * torch.randn(n, 4, generator=g)
    return x[rank::world], y[rank::world]


def save(model: nn.Module, opt: torch.optim.Optimizer, path: str) -> None:
    """Every rank writes its shards; rank 0 writes the ``.metadata`` file last."""
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=dcp.FileSystemWriter(path))


def load(model: nn.Module, opt: torch.optim.Optimizer, path: str) -> None:
    model_sd, optim_sd = get_state_dict(model, opt)  # the (sharded) shape to load into
    state = {"model": model_sd, "optim": optim_sd}
    # FSDP1 flattens parameters; when a parameter has fewer rows than there are ranks (the
    # 4-row output layer on 8 GPUs), some ranks hold no optimizer state for it and DCP's
    # strict load fails with a misleading "Missing key ... optim.param_groups". A partial
    # load is safe here: the keys that matter are all in the checkpoint we just wrote.
    dcp.load(
        state,
        storage_reader=dcp.FileSystemReader(path),
        planner=DefaultLoadPlanner(allow_partial_load=True),
    )
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


@distributed(processes=2)
def train(
    steps: int = 30,
    lr: float = 0.01,
    seed: int = 0,
    ckpt_dir: str | None = None,
    save_at: int | None = None,
    resume: bool = False,
) -> dict:
    """Train ``steps`` steps; save to ``ckpt_dir`` after step ``save_at``; or first
    ``resume`` from it. Returns the losses and the gathered (full) state dict."""
    # FSDP1's state dicts are ShardedTensors and use deprecated helpers; torch warns about
    # that on every call, from its own code. Keep the log readable.
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed.fsdp")
    device = gangrun.device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(gangrun.backend())
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(seed)
        model = FSDP(
            make_model().to(device),
            device_id=device,  # torch.device("cpu") on CPU: None would refuse to start
            auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),  # each Linear is its own unit
            use_orig_params=True,
        )
        opt = torch.optim.Adam(model.parameters(), lr=lr)
        if resume:
            assert ckpt_dir, "resume needs ckpt_dir"
            load(model, opt, ckpt_dir)
        x, y = (t.to(device) for t in make_data(rank, world))

        losses = []
        for step in range(1, steps + 1):
            opt.zero_grad(set_to_none=True)
            loss = F.mse_loss(model(x), y)
            loss.backward()  # gradients are reduce-scattered to their shards
            opt.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / world)
            if save_at == step:
                assert ckpt_dir, "save_at needs ckpt_dir"
                save(model, opt, ckpt_dir)
        # All-gather the shards into full tensors on every rank (fine for a small model;
        # for a big one add cpu_offload=True and only rank 0 keeps them).
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        params = {k: v.detach().cpu() for k, v in full.items()}
        if rank == 0:
            print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} after {steps} steps")
        return {"rank": rank, "losses": losses, "params": params}
    finally:
        dist.destroy_process_group()


def _main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--processes", type=int, help="CPU ranks (default: every GPU, else 2)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--ckpt", help="checkpoint directory: train, save halfway, resume, compare")
    p.add_argument("--no-mlflow", action="store_true")
    a = p.parse_args()
    fn = train.options(mlflow=not a.no_mlflow)
    if a.processes is not None:
        fn = fn.options(processes=a.processes)
    elif gangrun.accelerators():
        fn = fn.options(gpus=None)  # every GPU of this node
    else:
        fn = fn.options(processes=2)
    half = a.steps // 2
    ckpt = os.path.abspath(a.ckpt) if a.ckpt else None
    out = fn.distributed(steps=a.steps, ckpt_dir=ckpt, save_at=half if ckpt else None)
    losses = out[0]["losses"]
    print(f"{len(out)} ranks, loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    assert losses[-1] < losses[0], "loss did not decrease"
    for r in out[1:]:
        for k, v in r["params"].items():
            assert torch.equal(v, out[0]["params"][k]), f"rank {r['rank']} differs on {k}"
    if ckpt:
        again = fn.distributed(steps=a.steps - half, ckpt_dir=ckpt, resume=True)
        for k, v in again[0]["params"].items():
            torch.testing.assert_close(v, out[0]["params"][k], rtol=1e-4, atol=1e-5)
        print(f"resumed from {ckpt} at step {half}: same final parameters")
    print("OK")


if __name__ == "__main__":
    _main()
