"""Rank-side functions of the reliability tests (stdlib only at import: ranks import it)."""

from __future__ import annotations

import os
import signal
import time


def tagged(tag: str, sleep: float) -> dict:
    t0 = time.time()
    for i in range(3):
        print(f"tag={tag} line={i}", flush=True)
    time.sleep(sleep)
    return {
        "tag": tag,
        "port": os.environ["MASTER_PORT"],
        "run_dir": os.environ["GANGRUN_RUN_DIR"],
        "start": t0,
        "end": time.time(),
    }


def visible_devices(sleep: float) -> str:
    time.sleep(sleep)
    return os.environ.get("CUDA_VISIBLE_DEVICES", "")


def train(ckpt_dir: str, steps: int, kill_step: int | None) -> dict:
    """DDP on gloo with a checkpoint per step; rank 1 SIGKILLs itself after step
    ``kill_step`` on the first attempt only."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    path = os.path.join(ckpt_dir, "ckpt.pt")
    start = 0
    if os.path.exists(path):
        state = torch.load(path)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
        print(f"resuming from step {start} (attempt {attempt})", flush=True)
    losses = []
    for step in range(start, steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(16, 4, generator=g)
        y = x.sum(1, keepdim=True)
        loss = ((ddp(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if rank == 0:
            tmp = path + ".tmp"
            torch.save(
                {"model": model.state_dict(), "opt": opt.state_dict(), "step": step + 1}, tmp
            )
            os.replace(tmp, path)
        dist.barrier()  # the checkpoint of this step is complete before anyone goes on
        if rank == 1 and attempt == 0 and kill_step is not None and step + 1 == kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()
    return {
        "params": [p.detach().tolist() for p in model.parameters()],
        "attempt": attempt,
        "start": start,
    }


def stuck_in_collective() -> None:
    """Rank 0 blocks in a gloo all_reduce that rank 1 never joins (rank 1 sleeps)."""
    print("importing torch", flush=True)  # output is progress: startup is not a hang
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    print("ready", flush=True)
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))
    else:
        time.sleep(600)


def quiet_but_beating(seconds: float, how: str) -> int:
    import gangrun

    end = time.monotonic() + seconds
    i = 0
    while time.monotonic() < end:
        if how == "heartbeat":
            gangrun.heartbeat()
        else:
            print(f"step {i}", flush=True)
        i += 1
        time.sleep(0.1)
    return i


def open_up_run_dir() -> int:
    """Misbehave: make the run directory reachable by others before returning."""
    os.chmod(os.environ["GANGRUN_RUN_DIR"], 0o755)
    return 1


def echo(value: str) -> dict:
    return {"arg": value, "env": os.environ.get("SOAK_ECHO", ""), "cwd": os.getcwd()}


def listening_sockets() -> dict:
    import psutil
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    dist.all_reduce(torch.ones(1))
    socks = [
        (c.laddr.ip, c.laddr.port)
        for c in psutil.Process().net_connections("inet")
        if c.status == psutil.CONN_LISTEN
    ]
    dist.barrier()
    return {
        "listen": socks,
        "master_port": int(os.environ["MASTER_PORT"]),
        "master_addr": os.environ["MASTER_ADDR"],
        "ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
    }


def private_files() -> dict:
    import stat

    run_dir = os.environ["GANGRUN_RUN_DIR"]
    modes = {}
    for root, dirs, files in os.walk(run_dir):
        for name in dirs + files:
            p = os.path.join(root, name)
            try:
                modes[os.path.relpath(p, run_dir)] = stat.S_IMODE(os.lstat(p).st_mode)
            except FileNotFoundError:  # a peer's temp file, renamed between walk and stat
                continue
    modes["."] = stat.S_IMODE(os.lstat(run_dir).st_mode)
    return modes


def always_fail() -> None:
    """A failure worth retrying on every attempt (a connection error: not certain to repeat)."""
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    raise ConnectionResetError(f"attempt {attempt} failed: the data server went away")


def raise_on_rank1() -> int:
    """Rank 1 raises; rank 0 returns its rank."""
    rank = int(os.environ["RANK"])
    if rank == 1:
        raise ValueError("rank 1 is broken")
    return rank


def os_exit0_on_rank1() -> int:
    """Rank 1 leaves with os._exit(0): neither a result nor an error record."""
    rank = int(os.environ["RANK"])
    if rank == 1:
        os._exit(0)
    time.sleep(0.5)
    return rank


def import_by_name(name: str) -> dict:
    import importlib
    import sys

    mod = importlib.import_module(name)
    return {"value": mod.VALUE, "path": list(sys.path)}


def exit0_during_all_reduce() -> float:
    """Rank 1 calls sys.exit(0) while rank 0 waits for it in all_reduce (gloo)."""
    import sys

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    dist.barrier()
    if dist.get_rank() == 1:
        time.sleep(0.3)
        sys.exit(0)
    t = torch.ones(1)
    dist.all_reduce(t)
    return float(t.item())


class UnprintableError(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no text for you")


def raise_unprintable() -> None:
    raise UnprintableError("hidden")


# ---------------------------------------------------------------- restart rules
def _note_attempt(log: str) -> int:
    """Rank 0 appends this attempt's number and start time to ``log`` (the tests count
    attempts and measure the back-off from it)."""
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if os.environ["RANK"] == "0":
        with open(log, "a") as f:
            f.write(f"{attempt} {time.time():.6f}\n")
    return attempt


def same_line_after_a_step(log: str) -> None:
    """Every attempt reports a step, then rank 0 raises from the same line (rank 1 waits in a
    gloo barrier: its error is the echo of rank 0's exit)."""
    import torch.distributed as dist

    import gangrun

    _note_attempt(log)
    dist.init_process_group("gloo")
    gangrun.report_step(1, 10)
    dist.barrier()
    if dist.get_rank() == 0:
        raise ValueError("the loss is nan")  # the same line on every attempt
    dist.barrier()


def import_before_progress(log: str) -> None:
    _note_attempt(log)
    import gangrun_no_such_module  # noqa: F401


def killed_after_a_step(log: str) -> None:
    """Every attempt reports a step, then rank 1 SIGKILLs itself (rank 0 waits in a barrier)."""
    import torch.distributed as dist

    import gangrun

    _note_attempt(log)
    dist.init_process_group("gloo")
    gangrun.report_step(1, 10)
    dist.barrier()
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def bug_at_the_first_step(log: str, steps: int, bug: bool) -> int:
    """A Checkpointer-driven loop (1 rank); with ``bug``, a TypeError in the first step's body
    on every attempt, before that step completes."""
    import torch

    import gangrun

    _note_attempt(log)
    state = {"w": torch.zeros(2)}
    ckpt = gangrun.Checkpointer(state, every=1, async_save=False)
    for _ in ckpt.steps(steps):
        if bug:
            _ = state["w"] + "1"  # a TypeError, at the same line on every attempt
        state["w"] += 1
    return ckpt.step


def init_nccl(log: str) -> None:
    """``init_process_group("nccl")`` on this CPU-only torch: it always fails the same way."""
    import torch.distributed as dist

    _note_attempt(log)
    dist.init_process_group("nccl")


def saves_then_killed(log: str) -> None:
    """A Checkpointer saves steps 2 and 4 (synchronously), then the rank SIGKILLs itself in
    step 4 (every attempt: each waits out a back-off before the next)."""
    import torch

    import gangrun

    _note_attempt(log)
    state = {"w": torch.zeros(2)}
    ckpt = gangrun.Checkpointer(state, every=2, async_save=False)
    for step in ckpt.steps(10):
        state["w"] += 1
        if step == 4:
            os.kill(os.getpid(), signal.SIGKILL)


def outgrows_its_cgroup(procs_file: str, settle: float, ready_file: str) -> int:
    """Rank 1 moves itself into the memory cgroup of ``procs_file`` (its ``cgroup.procs``),
    waits ``settle`` seconds (its memory sampler sees the cgroup), then touches 16 MiB more
    every 20 ms until the out-of-memory killer kills it; rank 0 sleeps."""
    if os.environ["RANK"] != "1":
        time.sleep(120)
        return 0
    with open(procs_file, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(settle)
    with open(ready_file, "w") as f:
        f.write(str(os.getpid()))
    held = []
    for _ in range(4096):  # 64 GiB: far past any limit the test sets
        held.append(b"\x01" * (16 << 20))  # written: every page resident
        time.sleep(0.02)
    return len(held)


class _Grows:
    """A data set whose first item grows by 16 MiB every 20 ms, without end."""

    def __len__(self) -> int:
        return 1

    def __getitem__(self, i: int) -> int:
        held = []
        for _ in range(4096):
            held.append(b"\x01" * (16 << 20))
            time.sleep(0.02)
        return len(held)


def worker_outgrows_its_cgroup(procs_file: str, settle: float) -> int:
    """Rank 1 moves itself into the memory cgroup of ``procs_file`` and waits ``settle``
    seconds; then its DataLoader's one worker (in the cgroup with it) grows until the
    out-of-memory killer kills it, and the rank raises torch's error; rank 0 sleeps."""
    if os.environ["RANK"] != "1":
        time.sleep(120)
        return 0
    from torch.utils.data import DataLoader

    with open(procs_file, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(settle)
    return sum(len(batch) for batch in DataLoader(_Grows(), num_workers=1))
