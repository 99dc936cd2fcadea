"""The rank side of the resume-exactness harness (tests/soak/test_resume_exactness.py).

`train` is a training written as a user writes one from docs/long_runs.md: a small MLP with
dropout under DDP, AdamW + StepLR, a loader (`VolumeDataset`'s, `TableDataset`'s, or a plain
``DataLoader`` with its own generator, put in the state as it is), plain values that change as it trains (``epoch`` and
``best`` reassigned, ``epoch_ends`` appended to), one ``gangrun.Checkpointer`` over all of it,
and the loss logged through the manager on every rank, as the recipe does.

The harness adds two things a user would not write, neither touching the training's state:

* a trace: each rank appends, for every step it runs (replayed steps again), a JSON line with
  the batch's checksum, the epoch, its loss and the ranks' mean loss, to
  ``<trace>/rank<R>.jsonl``; the test compares every line with the uninterrupted run's;
* interruptions (``cfg["events"]``, each once, in order, by marker files in ``<trace>``):
  ``rank_kill`` SIGKILLs one rank after the step's update; ``caller_kill``, ``sigterm`` and
  ``cancel`` hold every rank at the step on a gate (``gate<i>.reached.<R>``, released by the
  file ``gate<i>``; ``gate<i>.stop.<R>`` once the rank sees the stop request) while the test
  interrupts the caller. With ``settle`` the save in flight
  is committed first (``ckpt.wait()``), so the resume starts from the newest save due.

stdlib only at import: ranks import this module by reference.
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
from typing import Any

DIM = 6  # inputs per sample (a target follows)
ROWS_PER_FILE = 4  # VolumeDataset: samples per file
BATCH = 2
SAMPLES_PER_RANK = 12  # every loader: 6 batches per rank and epoch
GATE_WAIT_S = 120.0


# ----------------------------------------------------------------------------- data
def files_per_rank() -> int:
    return SAMPLES_PER_RANK // ROWS_PER_FILE


def write_volume(root: str, world: int) -> None:
    """``3 * world`` files of ``ROWS_PER_FILE`` samples (``DIM`` inputs + 1 target, float32)."""
    import numpy as np

    os.makedirs(root, exist_ok=True)
    rng = np.random.default_rng(1000 + world)
    for i in range(files_per_rank() * world):
        x = rng.standard_normal((ROWS_PER_FILE, DIM + 1)).astype("float32")
        with open(os.path.join(root, f"f{i:03d}.bin"), "wb") as f:
            f.write(x.tobytes())


def write_table(root: str, world: int) -> None:
    """One Parquet file of ``12 * world`` rows in row groups of 4: columns ``f0..f5``, ``y``."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(root, exist_ok=True)
    rng = np.random.default_rng(2000 + world)
    data = rng.standard_normal((SAMPLES_PER_RANK * world, DIM + 1)).astype("float32")
    cols = {f"f{i}": data[:, i] for i in range(DIM)}
    cols["y"] = data[:, DIM]
    pq.write_table(pa.table(cols), os.path.join(root, "part-000.parquet"), row_group_size=4)


def decode_rows(raw: bytes) -> Any:
    """A file's samples, one by one."""
    import torch

    rows = torch.frombuffer(bytearray(raw), dtype=torch.float32).reshape(-1, DIM + 1)
    return iter(list(rows))


def _loader(cfg: dict[str, Any], data: str, rank: int) -> tuple[Any, Any, Any]:
    """(the loader, what the state holds of it: the loader, or with ``cfg["hold"] ==
    "dataset"`` its dataset, the dataset's ``set_epoch`` or None)."""
    import torch

    nw, shuffle = int(cfg["workers"]), bool(cfg["shuffle"])
    if cfg["loader"] == "volume":
        from gangrun.data import VolumeDataset

        vds = VolumeDataset(data, shuffle=shuffle, seed=5, decode=decode_rows)
        vl = vds.loader(batch_size=BATCH, num_workers=nw)
        return vl, (vds if cfg["hold"] == "dataset" else vl), vds.set_epoch
    if cfg["loader"] == "table":
        from gangrun.data import TableDataset

        tds = TableDataset(
            data, batch_size=BATCH, shuffle=shuffle, seed=5, shuffle_buffer=4, cache=False
        )
        tl = tds.loader(num_workers=nw)
        return tl, (tds if cfg["hold"] == "dataset" else tl), tds.set_epoch
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(50 + rank)
    xs = torch.randn(SAMPLES_PER_RANK, DIM + 1, generator=g)
    plain = DataLoader(
        TensorDataset(xs),
        batch_size=BATCH,
        shuffle=shuffle,
        num_workers=nw,
        generator=torch.Generator().manual_seed(7 + rank),
    )
    return plain, plain, None  # in the state as it is: the manager records its position


def _xy(cfg: dict[str, Any], batch: Any) -> tuple[Any, Any]:
    import torch

    if cfg["loader"] == "table":
        full = torch.stack([batch[f"f{i}"] for i in range(DIM)] + [batch["y"]], 1)
    elif cfg["loader"] == "plain":
        full = batch[0]
    else:
        full = batch
    return full[:, :DIM], full[:, DIM:]


# ----------------------------------------------------------------------------- interruptions
def _event_done(trace: str, i: int) -> bool:
    """Event ``i`` happened: its rank was killed, or the test opened its gate."""
    done = (os.path.join(trace, f"event{i}.done"), os.path.join(trace, f"gate{i}"))
    return i < 0 or any(os.path.exists(p) for p in done)


def _interrupt(cfg: dict[str, Any], trace: str, step: int, rank: int, ckpt: Any) -> None:
    """Fire the next event of ``cfg["events"]`` if it is due at ``step``."""
    for i, ev in enumerate(cfg["events"]):
        if _event_done(trace, i):
            continue
        if not _event_done(trace, i - 1) or ev["step"] != step:
            return
        if ev["settle"]:
            ckpt.wait()
        if ev["kind"] == "rank_kill":
            if rank == ev["rank"] % cfg["world"]:
                open(os.path.join(trace, f"event{i}.done"), "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
            return
        import gangrun

        gate = os.path.join(trace, f"gate{i}")
        open(f"{gate}.reached.{rank}", "w").close()
        deadline, told = time.monotonic() + GATE_WAIT_S, False
        while not os.path.exists(gate):
            if not told and gangrun.should_stop():  # the test waits for this before opening
                open(f"{gate}.stop.{rank}", "w").close()
                told = True
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank {rank}: the test never opened {gate}")
            time.sleep(0.01)
        return


# ----------------------------------------------------------------------------- the training
def train(cfg: dict[str, Any], data: str, trace: str) -> dict[str, Any]:
    import zlib

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    import gangrun

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(DIM, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 16), nn.ReLU(),
        nn.Linear(16, 1),
    )  # fmt: skip
    model = DistributedDataParallel(net)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.7)
    torch.manual_seed(100 + rank)  # each rank's dropout stream (restored with the rank's RNGs)
    loader, held, set_epoch = _loader(cfg, data, rank)
    state: dict[str, Any] = {
        "model": model,
        "optim": opt,
        "sched": sched,
        "loader": held,
        "epoch": 0,
        "best": math.inf,
        "epoch_ends": [],
    }
    ckpt = gangrun.Checkpointer(
        state,
        every=cfg["every"],
        every_seconds=cfg["every_seconds"],
        keep=cfg["keep"],
        async_save=cfg["async_save"],
    )

    def batches() -> Any:
        while True:
            yield from loader
            state["epoch_ends"].append(state["epoch"])  # a plain list, grown in place
            state["epoch"] += 1  # a plain value, reassigned
            if set_epoch is not None:
                set_epoch(state["epoch"])

    it = batches()
    path = os.path.join(trace, f"rank{rank}.jsonl")
    first = True
    for step in ckpt.steps(cfg["total"]):
        batch = next(it)
        if first:  # where this attempt started
            first = False
            with open(path, "a") as f:
                f.write(json.dumps({"start": step, "pid": os.getpid()}) + "\n")
        x, y = _xy(cfg, batch)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        mean_loss = mean.item() / world
        if mean_loss < state["best"]:
            state["best"] = mean_loss  # a plain value, reassigned
        crc = zlib.crc32(torch.cat([x, y], 1).contiguous().numpy().tobytes())
        line = {
            "step": step,
            "crc": crc,
            "epoch": state["epoch"],
            "loss": float(loss).hex(),
            "mean": mean_loss.hex(),
        }
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")
        ckpt.log_metrics({"loss": mean_loss}, step)  # every rank, as docs/long_runs.md does
        _interrupt(cfg, trace, step, rank, ckpt)
    params = {k: v.detach().clone() for k, v in net.state_dict().items()}
    out = {
        "rank": rank,
        "params": params,
        "epoch": state["epoch"],
        "best": state["best"],
        "epoch_ends": list(state["epoch_ends"]),
        "restored_from": ckpt.restored_from,
    }
    dist.barrier()
    dist.destroy_process_group()
    return out


def plain_loader_in_state(where: str) -> None:
    """A plain ``DataLoader`` shuffled by torch's global generator, put in the state."""
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    import gangrun

    dist.init_process_group("gloo")
    loader = DataLoader(TensorDataset(torch.zeros(4, 1)), batch_size=2, shuffle=True)
    gangrun.Checkpointer({"loader": loader}, dir=where).restore()
