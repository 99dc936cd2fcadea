"""Checkpoints: how long a training step is blocked by a save, and how long a restore takes.

    PYTHONPATH=src python bench/bench_checkpoint.py --reps 3      # BENCH_CKPT_GIB=1 (default)

2 ranks (gloo, CPU), each holding ``BENCH_CKPT_GIB`` GiB of state: an FSDP2 (``fully_shard``) model of
``2 x gib`` GiB of float32 parameters, sharded (each rank saves its own half). On local disk
under the temp directory. Per repetition, on each rank (the slower rank counts):

* ``async``: ``Checkpointer.save()`` with asynchronous saves (one manager for all
  repetitions, as in a training loop: its staging copy is reused): the time the training step
  is blocked (the copy of the state off the parameters; the write runs in the background),
  and the time until the checkpoint is committed;
* ``dcp_sync``: the same save, synchronous (``async_save=False``): DCP write + fsync + commit;
* ``torch_save``: ``torch.save`` of the same local shards into one file per rank, with an
  ``fsync`` (durable, as a checkpoint must be), and without;
* ``copy``: the floor of a non-blocking save: copying the rank's local shards into CPU
  buffers allocated beforehand (``Tensor.copy_``), which any async checkpointer must do
  before the step may change the parameters; target: the async block <= 2x this copy;
* ``restore``: ``Checkpointer.restore()`` of the newest checkpoint into the model, against
  ``torch.load`` of the torch.save file.

Ratios: blocked-by-async / the preallocated copy, / dcp_sync and / torch_save,
restore / torch.load.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

from _common import main, report


def ranks(gib: float, reps: int, where: str) -> dict:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    import gangrun

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    side = 8192
    layers = max(1, round(2 * gib * (1 << 30) / (side * side * 4)))
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(side, side, bias=False) for _ in range(layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    local = sum(p.to_local().numel() * 4 for p in model.parameters())
    keys = ("blocked", "committed", "sync", "ts", "tsn", "copy")
    out: dict[str, list[float]] = {k: [] for k in keys}
    out.update({"restore": [], "load": []})

    def sync_all() -> None:
        dist.barrier()

    # one writer per location: the async manager, the sync one and the restoring one each
    # have their own directory (the sync one's is restored from)
    root, sync_root = os.path.join(where, "ckpt"), os.path.join(where, "sync")
    ck = gangrun.Checkpointer({"model": model}, dir=root, keep=None)  # one manager, as in a loop
    ck.restore()
    bufs = [torch.empty_like(p.to_local()) for p in model.parameters()]  # allocated beforehand
    for rep in range(reps):
        sync_all()
        t = time.perf_counter()
        for b, p in zip(bufs, model.parameters(), strict=True):
            b.copy_(p.to_local())
        out["copy"].append(time.perf_counter() - t)
        sync_all()
        ck.step = 2 * rep
        t = time.perf_counter()
        ck.save()
        out["blocked"].append(time.perf_counter() - t)
        ck.wait()
        out["committed"].append(time.perf_counter() - t)
        sync_all()
        ck2 = gangrun.Checkpointer({"model": model}, dir=sync_root, keep=None, async_save=False)
        ck2.restore()
        ck2.step = 2 * rep + 1
        sync_all()
        t = time.perf_counter()
        ck2.save()
        out["sync"].append(time.perf_counter() - t)
        ck2.close()
        shards = {n: p.to_local() for n, p in model.named_parameters()}
        path = os.path.join(where, f"torch-{rank}.pt")
        sync_all()
        t = time.perf_counter()
        torch.save(shards, path + ".nosync")
        out["tsn"].append(time.perf_counter() - t)
        sync_all()
        t = time.perf_counter()
        with open(path, "wb") as f:
            torch.save(shards, f)
            f.flush()
            os.fsync(f.fileno())
        out["ts"].append(time.perf_counter() - t)
        sync_all()
        ck3 = gangrun.Checkpointer({"model": model}, dir=sync_root, keep=None)
        t = time.perf_counter()
        ck3.restore()
        out["restore"].append(time.perf_counter() - t)
        ck3.close()
        sync_all()
        t = time.perf_counter()
        back = torch.load(path)
        out["load"].append(time.perf_counter() - t)
        del back
        sync_all()
        if rank == 0:
            for d in (root, sync_root):
                for name in os.listdir(d):
                    if name.startswith("step-"):
                        shutil.rmtree(os.path.join(d, name), ignore_errors=True)
        sync_all()
    ck.close()
    dist.destroy_process_group()
    return {"rank": rank, "bytes": local, **out}


def run(reps: int) -> dict:
    gib = float(os.environ.get("BENCH_CKPT_GIB", "1"))
    where = tempfile.mkdtemp(prefix="bench-ckpt-")
    try:
        fn = gangrun_fn()
        per_rank = fn.distributed(gib, reps, where)
    finally:
        shutil.rmtree(where, ignore_errors=True)
    # per repetition, the slower rank
    worst = {
        k: [max(r[k][i] for r in per_rank) for i in range(reps)]
        for k in ("blocked", "committed", "sync", "ts", "tsn", "copy", "restore", "load")
    }
    series = {
        "async_blocked": worst["blocked"],
        "async_committed": worst["committed"],
        "dcp_sync_save": worst["sync"],
        "torch_save_fsync": worst["ts"],
        "torch_save": worst["tsn"],
        "prealloc_copy": worst["copy"],
        "restore": worst["restore"],
        "torch_load": worst["load"],
    }
    res = report(
        "checkpoint",
        series,
        {
            "async_blocked_vs_prealloc_copy": ("async_blocked", "prealloc_copy"),
            "async_blocked_vs_dcp_sync": ("async_blocked", "dcp_sync_save"),
            "async_blocked_vs_torch_save_fsync": ("async_blocked", "torch_save_fsync"),
            "async_blocked_vs_torch_save": ("async_blocked", "torch_save"),
            "dcp_sync_vs_torch_save_fsync": ("dcp_sync_save", "torch_save_fsync"),
            "restore_vs_torch_load": ("restore", "torch_load"),
        },
    )
    return {"state_bytes_per_rank": per_rank[0]["bytes"], "ranks": len(per_rank), **res}


def gangrun_fn():
    from gangrun import distributed

    return distributed(processes=2, mlflow=False, timeout=1800, output="rank0")(ranks)


if __name__ == "__main__":
    main(run, default_reps=3)
