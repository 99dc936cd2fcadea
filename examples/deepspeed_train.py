"""DeepSpeed ZeRO (stage 1, 2 or 3) under gangrun, with DeepSpeed's own checkpoints.

The ZeRO stage is a field of the config dict; everything else is the usual
``deepspeed.initialize`` / ``engine.backward`` / ``engine.step`` loop. On CPU the example
avoids every op DeepSpeed would JIT-compile with gcc+ninja: the optimizer is torch's Adam
(``torch_adam: true``, not FusedAdam), and ``deepspeed_setup()`` skips the shared-memory
all-reduce op (collectives then go through gloo). On GPUs the same code uses nccl.

    python examples/deepspeed_train.py --stage 3                 # every GPU, else 2 CPU ranks
    python examples/deepspeed_train.py --stage 2 --ckpt /tmp/ds  # train, save, resume
"""

from __future__ import annotations

import argparse
import os
import warnings

import torch
import torch.nn.functional as F
from torch import nn

import gangrun
from gangrun import distributed
from gangrun.compat.frameworks import deepspeed_setup


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def make_data(rank: int, world: int, n: int = 512, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    y = torch.tanh(x @ torch.randn(16, 4, generator=g)) + 0.05 * torch.randn(n, 4, generator=g)
    return x[rank::world], y[rank::world]


def ds_config(stage: int, lr: float, micro_batch: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": micro_batch,  # per rank; train_batch_size is derived
        "gradient_accumulation_steps": 1,
        "optimizer": {
            "type": "Adam",
            # torch.optim.Adam instead of DeepSpeed's FusedAdam: no C++ build on CPU.
            "params": {"lr": lr, "torch_adam": True},
        },
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,  # keep DeepSpeed's own progress lines out of the log
        "wall_clock_breakdown": False,
    }


@distributed(processes=2)
def train(
    stage: int = 2,
    steps: int = 30,
    lr: float = 0.01,
    seed: int = 0,
    ckpt_dir: str | None = None,
    save_at: int | None = None,
    resume: bool = False,
) -> dict:
    """Train ``steps`` steps with ZeRO ``stage``; save to ``ckpt_dir`` after step
    ``save_at``; or first ``resume`` from it. Returns losses and the gathered state dict."""
    # DeepSpeed calls torch collectives that torch now marks deprecated; keep the log readable.
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    deepspeed_setup()  # DeepSpeed's env vars + accelerator; on CPU no shm op JIT build
    import deepspeed  # after deepspeed_setup, so it picks the accelerator set there

    device = gangrun.device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    deepspeed.init_distributed(dist_backend=gangrun.backend())  # reads RANK, MASTER_ADDR, ...
    rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
    torch.manual_seed(seed)
    x, y = (t.to(device) for t in make_data(rank, world))
    model = make_model()  # on CPU; deepspeed.initialize moves it to this rank's device
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        config=ds_config(stage, lr, micro_batch=len(x)),
    )  # ZeRO-3 partitions the parameters across the ranks here
    if resume:
        assert ckpt_dir, "resume needs ckpt_dir"
        path, _ = engine.load_checkpoint(ckpt_dir)  # the tag named in ckpt_dir/latest
        assert path is not None, f"no DeepSpeed checkpoint under {ckpt_dir}"

    losses = []
    for step in range(1, steps + 1):
        loss = F.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        deepspeed.comm.all_reduce(mean)
        losses.append(mean.item() / world)
        if save_at == step:
            assert ckpt_dir, "save_at needs ckpt_dir"
            engine.save_checkpoint(ckpt_dir, tag=f"step{step}")  # every rank: its own shards

    # Full parameters on every rank: ZeRO-3 gathers its partitions inside this block;
    # with stages 1 and 2 the parameters are whole already and it does nothing.
    params_list = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params_list, modifier_rank=None):
        params = {k: v.detach().cpu().clone() for k, v in engine.module.state_dict().items()}
    if rank == 0:
        print(f"ZeRO-{stage}: loss {losses[0]:.4f} -> {losses[-1]:.4f} after {steps} steps")
    deepspeed.comm.barrier()
    engine.destroy()
    deepspeed.comm.destroy_process_group()
    return {"rank": rank, "losses": losses, "params": params}


def _main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stage", type=int, choices=(1, 2, 3), default=2)
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
    kw = {"stage": a.stage, "ckpt_dir": ckpt}
    out = fn.distributed(steps=a.steps, save_at=half if ckpt else None, **kw)
    losses = out[0]["losses"]
    print(f"{len(out)} ranks, ZeRO-{a.stage}, loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    assert losses[-1] < losses[0], "loss did not decrease"
    for r in out[1:]:
        for k, v in r["params"].items():
            assert torch.equal(v, out[0]["params"][k]), f"rank {r['rank']} differs on {k}"
    if ckpt:
        again = fn.distributed(steps=a.steps - half, resume=True, **kw)
        for k, v in again[0]["params"].items():
            torch.testing.assert_close(v, out[0]["params"][k], rtol=1e-4, atol=1e-5)
        print(f"resumed from {ckpt} at step {half}: same final parameters")
    print("OK")


if __name__ == "__main__":
    _main()
