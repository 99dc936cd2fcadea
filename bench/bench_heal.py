"""Memory snapshots: what one costs, how fast it restores, and what a killed rank costs.

    PYTHONPATH=src python bench/bench_heal.py --reps 3      # BENCH_HEAL_GIB=1 (default)

In one process, a ``torch.nn.Module`` of ``BENCH_HEAL_GIB`` GiB of float32 parameters (the
state of one rank), snapshotted the way a `gangrun.Checkpointer` does at a step boundary
(`gangrun.rank.snapshots.MemorySnapshots`, in a keeper's ``/dev/shm`` directory). Per
repetition, in alternating order:

* ``snapshot_blocked``: the time the step is blocked (the state dict, its table of contents,
  the copy into the older slot; the checksums then run in a background thread);
* ``snapshot_complete``: until the slot is complete (its checksums and header written);
* ``prealloc_shm_copy``: the floor: ``Tensor.copy_`` of the same parameters into shared
  memory allocated and touched beforehand;
* ``restore_memory``: the slot verified (CRC-32s), read back into the model's own tensors
  and loaded, as a restart's ``Checkpointer.restore`` does;
* ``restore_storage``: the same state restored from a storage checkpoint on local disk
  (`gangrun.checkpoint.save` beforehand; the restore as ``Checkpointer.restore`` reads it).

Then gangs of 2 gloo ranks (a DDP MLP, ``BENCH_HEAL_STEPS`` steps, storage checkpoints every
100): rank 1 SIGKILLed inside step ``BENCH_HEAL_KILL`` under ``max_restarts=1``, with memory
snapshots every step, at the default interval, and off (today's restart from storage): the
seconds from the kill to the first step committed after it (the restarted rank 0's
``step_done`` of the interrupted step) and the steps redone; and the loop's steps/s without a
kill over ``BENCH_HEAL_LOOP_STEPS`` steps (2000), default interval against ``memory=False``.

Ratios: snapshot_blocked / prealloc_shm_copy, restore_memory / restore_storage,
steps/s default / off.
"""

from __future__ import annotations

import mmap
import os
import shutil
import signal
import tempfile
import time
import uuid

from _common import interleaved, main, median, report


def _model(gib: float):
    import torch
    from torch import nn

    side = 4096
    layers = max(1, round(gib * (1 << 30) / (side * side * 4)))
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(side, side, bias=False) for _ in range(layers)])


def single(reps: int, gib: float) -> dict[str, list[float]]:
    import torch

    from gangrun.checkpoint import state as _state
    from gangrun.host import keeper
    from gangrun.rank.checkpoint_io import CheckpointIO
    from gangrun.rank.snapshots import MemorySnapshots, choose

    model = _model(gib)
    state = {"model": model}
    e = _state.classify(state, 0)
    k = keeper.start(f"bench-{uuid.uuid4().hex[:8]}")
    mem = MemorySnapshots(k.path, 0, 1, 1, 1 << 40)
    params = [p.detach() for p in model.parameters()]
    nbytes = sum(p.numel() * p.element_size() for p in params)
    shm = os.path.join(k.path, "floor")
    with open(shm, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, nbytes)
    fd = os.open(shm, os.O_RDWR)
    buf = mmap.mmap(fd, nbytes)
    floor = [torch.frombuffer(buf, dtype=torch.uint8)]  # cleared before the buffer closes
    floor[0].fill_(1)  # touched: the pages exist
    where = tempfile.mkdtemp(prefix="bench-heal-")
    url = os.path.join(where, "step-000000001")
    from gangrun import checkpoint

    checkpoint.save(_state.save_dict(e, 0, {"step": 1, "metrics": []}), url)
    io = CheckpointIO({}, async_save=False)
    step = iter(range(1, 10**9))
    build = lambda: _state.save_dict(e, 0, {"step": 1, "metrics": []}, encode=dict)  # noqa: E731

    def blocked() -> float:
        t = time.perf_counter()
        mem.take(next(step), build)
        took = time.perf_counter() - t
        mem.wait()
        return took

    def complete() -> float:
        t = time.perf_counter()
        mem.take(next(step), build)
        mem.wait()
        return time.perf_counter() - t

    def copy() -> float:
        t = time.perf_counter()
        off = 0
        for p in params:
            n = p.numel() * p.element_size()
            floor[0][off : off + n].copy_(p.reshape(-1).view(torch.uint8))
            off += n
        return time.perf_counter() - t

    def from_memory() -> float:
        fresh = MemorySnapshots(k.path, 0, 1, 1, 1 << 40)
        t = time.perf_counter()
        got = choose(fresh, None, lambda v: [v], lambda: _state.load_template(e, 0))
        assert got is not None
        _state.apply(e, _state.encoded_blob(got[1], 0), 0, state)
        took = time.perf_counter() - t
        fresh.close()
        mem.restored(got[0], mem.complete().get(got[0]))  # the writer's view again
        return took

    def from_storage() -> float:
        t = time.perf_counter()
        io.read(e, url, 0, None, None, state)
        return time.perf_counter() - t

    try:
        blocked()  # warm-up: the slots allocated
        blocked()
        return interleaved(
            reps,
            {
                "snapshot_blocked": blocked,
                "snapshot_complete": complete,
                "prealloc_shm_copy": copy,
                "restore_memory": from_memory,
                "restore_storage": from_storage,
            },
        )
    finally:
        floor.clear()
        buf.close()
        os.close(fd)
        mem.close()
        k.stop()
        shutil.rmtree(where, ignore_errors=True)


# ------------------------------------------------------------------------ the gang part
def train(total: int, kill_at: int | None, marker: str) -> dict:
    """A DDP MLP; rank 1 SIGKILLs itself inside step ``kill_at`` once (the time in
    ``marker``); returns when each step was committed (``step_done`` returned) and where the
    attempt started."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    import gangrun

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ckpt = gangrun.Checkpointer({"model": model, "optim": opt}, every=100, keep=2)
    x = torch.randn(32, 65)
    ckpt.restore()
    spent = [0.0, 0]  # seconds in snapshots, snapshots (the manager's own, looked into)
    mem = ckpt._mem
    if mem is not None:
        take = mem.take

        def timed_take(*a: object) -> None:
            t = time.perf_counter()
            take(*a)  # type: ignore[arg-type]
            spent[0] += time.perf_counter() - t
            spent[1] += 1

        mem.take = timed_take  # type: ignore[method-assign]
    done: dict[int, float] = {}
    t0, prev = None, None
    for step in ckpt.steps(total):
        if prev is not None:
            done[prev] = time.time()  # step_done of the step before has returned
        prev = step
        if t0 is None:
            t0 = time.perf_counter()
        loss = nn.functional.mse_loss(model(x[:, :64]), x[:, 64:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step == kill_at and rank == 1 and not os.path.exists(marker):
            with open(marker, "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
    if prev is not None:
        done[prev] = time.time()
    loop_s = time.perf_counter() - (t0 or time.perf_counter())
    return {
        "first": min(done, default=None),
        "done": done,
        "loop_s": loop_s,
        "snapshot_s": spent[0],
        "snapshots": spent[1],
    }


def gangs(reps: int, steps: int, kill: int, loop_steps: int) -> tuple[dict[str, list[float]], dict]:
    import gangrun

    def call(nokill: bool = False, total: int = steps, **opts):
        where = tempfile.mkdtemp(prefix="bench-heal-ckpt-")
        marker = os.path.join(where, "killed")
        fn = gangrun.distributed(
            processes=2, mlflow=False, output="none", checkpoint_dir=where, max_restarts=1, **opts
        )(train)
        try:
            out = fn.distributed(total, None if nokill else kill, marker)
            killed = None
            if os.path.exists(marker):
                with open(marker) as f:
                    killed = float(f.read())
        finally:
            shutil.rmtree(where, ignore_errors=True)
        return out, killed

    redone: dict[str, list[int]] = {}
    shares: list[float] = []
    counts: list[int] = []

    def killed(name: str, **opts):
        def run() -> float:
            out, t_kill = call(**opts)
            first = out[0]["first"]  # the first step the restarted attempt ran
            assert t_kill is not None and first is not None and first <= kill
            redone.setdefault(name, []).append(kill - first + 1)
            # the step after the kill (`kill`) committed: the first done of the interrupted one
            return out[0]["done"][kill] - t_kill

        return run

    def loop(**opts):
        def run() -> float:
            out, _ = call(nokill=True, total=loop_steps, **opts)
            if "memory" not in opts:  # the share of the loop spent in snapshots, per rank
                shares.append(max(o["snapshot_s"] / o["loop_s"] for o in out))
                counts.append(max(o["snapshots"] for o in out))
            return loop_steps / max(o["loop_s"] for o in out)

        return run

    times = interleaved(
        reps,
        {
            "kill_to_step_memory_every_1": killed("memory_every_1", memory_every=1),
            "kill_to_step_memory_default": killed("memory_default"),
            "kill_to_step_storage_only": killed("storage_only", memory=False),
            "steps_per_s_memory_default": loop(),
            "steps_per_s_memory_off": loop(memory=False),
        },
    )
    extra = {k: median([float(x) for x in v]) for k, v in redone.items()}
    extra["snapshot_share_of_loop"] = median(shares)
    extra["snapshots_in_loop"] = median([float(c) for c in counts])
    return times, extra


def run(reps: int) -> dict:
    gib = float(os.environ.get("BENCH_HEAL_GIB", "1"))
    steps = int(os.environ.get("BENCH_HEAL_STEPS", "300"))
    kill = int(os.environ.get("BENCH_HEAL_KILL", "250"))
    loop_steps = int(os.environ.get("BENCH_HEAL_LOOP_STEPS", "2000"))
    times = single(reps, gib)
    redone: dict = {}
    if os.environ.get("BENCH_HEAL_GANGS", "1") != "0":  # 0: the single-process part alone
        more, redone = gangs(reps, steps, kill, loop_steps)
        times.update(more)
    res = report(
        "heal",
        times,
        {
            "snapshot_blocked_vs_prealloc_copy": ("snapshot_blocked", "prealloc_shm_copy"),
            "restore_memory_vs_storage": ("restore_memory", "restore_storage"),
            "steps_per_s_default_vs_off": (
                "steps_per_s_memory_default",
                "steps_per_s_memory_off",
            ),
            "kill_to_step_memory_vs_storage": (
                "kill_to_step_memory_every_1",
                "kill_to_step_storage_only",
            ),
        }
        if redone
        else {
            "snapshot_blocked_vs_prealloc_copy": ("snapshot_blocked", "prealloc_shm_copy"),
            "restore_memory_vs_storage": ("restore_memory", "restore_storage"),
        },
    )
    res["state_gib"] = gib
    res["steps_redone_median"] = redone
    res["steps"], res["kill_at"], res["loop_steps"] = steps, kill, loop_steps
    return res


if __name__ == "__main__":
    main(run, default_reps=3)
