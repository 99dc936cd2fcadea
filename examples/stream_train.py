"""Stream training files from any storage and checkpoint every N steps; resume after a restart.

    python examples/stream_train.py                       # makes a small local dataset
    python examples/stream_train.py --source s3://bucket/shards/ --ckpt s3://bucket/run1

Each file holds a batch of (x, y) rows saved with ``torch.save``. Every rank reads its share of
the files (``VolumeDataset``), trains a DDP model, and every ``--every`` steps all ranks write a
checkpoint (model, optimizer, step and the dataset's position) with ``gangrun.checkpoint``.
Run it twice: the second run continues from the newest complete checkpoint, mid-epoch.
"""

from __future__ import annotations

import argparse
import io
import os
import tempfile

from gangrun import distributed


def decode(data: bytes):
    import torch

    rows = torch.load(io.BytesIO(data))
    return iter(list(zip(rows["x"], rows["y"], strict=True)))  # an iterator: many samples


def train(source: str, ckpt_root: str, epochs: int, every: int, batch_size: int) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gangrun import checkpoint
    from gangrun.data import VolumeDataset

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ds = VolumeDataset(source, decode=decode, shuffle=True, seed=0)
    loader = ds.loader(batch_size=batch_size, num_workers=1)

    step = 0
    last = checkpoint.latest(ckpt_root)
    if last is not None:
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd, "data": ds, "step": 0}
        checkpoint.load(state, last)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        step = state["step"]
        if rank == 0:
            print(f"resumed from {last} at step {step}, epoch {ds.epoch}")

    loss = torch.tensor(0.0)
    for epoch in range(ds.epoch, epochs):
        ds.set_epoch(epoch)
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x).squeeze(-1), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if step % every == 0:
                msd, osd = get_state_dict(model, opt)
                state = {"model": msd, "optim": osd, "data": ds, "step": step}
                checkpoint.save(state, f"{ckpt_root}/step-{step:07d}")
                if rank == 0:
                    print(
                        f"epoch {epoch} step {step} loss {loss.detach().item():.4f} (checkpointed)"
                    )
    out = {"step": step, "loss": float(loss.detach())}
    # the DDP model and the loader (its kept worker) go before their process group: freed
    # after it, their destructors can wait on it for good
    del model, opt, loader
    dist.destroy_process_group()
    return out


def make_dataset(root: str, files: int = 21, rows: int = 16) -> None:
    import torch

    os.makedirs(root, exist_ok=True)
    g = torch.Generator().manual_seed(1)
    w = torch.randn(8, generator=g)
    for i in range(files):
        x = torch.randn(rows, 8, generator=g)
        torch.save({"x": x, "y": x @ w}, os.path.join(root, f"part-{i:05d}.pt"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", help="directory, glob or fsspec URL of the training files")
    ap.add_argument("--ckpt", help="checkpoint root (any fsspec URL)")
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=8)
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="stream-train-")
    source = args.source or os.path.join(work, "data")
    if not args.source:
        make_dataset(source)
    ckpt = args.ckpt or os.path.join(work, "ckpt")
    run = distributed(processes=args.processes, mlflow=False)(train)
    print(run.distributed(source, ckpt, args.epochs, args.every, args.batch_size))


if __name__ == "__main__":
    main()
