"""Functions the core system tests run on every rank (importable by reference in ranks)."""

from __future__ import annotations

import os
import signal
import sys
import time


def rank() -> int:
    return int(os.environ["RANK"])


def report_env(x: int) -> dict:
    keys = [
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "NODE_RANK",
        "GROUP_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "PYTHONUNBUFFERED",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
        "OMP_NUM_THREADS",
        "TORCHELASTIC_RESTART_COUNT",
        "EXTRA",
    ]
    print(f"hello from rank {rank()}")
    print(f"to stderr from rank {rank()}", file=sys.stderr)
    return {
        "value": rank() * x,
        "env": {k: os.environ.get(k) for k in keys},
        "cwd": os.getcwd(),
        "sys_path": list(sys.path),
        "pgid_is_pid": os.getpgrp() == os.getpid(),
        "sid_is_pid": os.getsid(0) == os.getpid(),
    }


def write_pid(pid_dir: str, name: str | None = None) -> None:
    name = name or f"rank{rank()}"
    with open(os.path.join(pid_dir, f"{name}.{os.getpid()}"), "w"):
        pass


def raise_while_other_blocks(pid_dir: str) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    write_pid(pid_dir)
    if rank() == 1:
        time.sleep(0.3)
        raise ValueError("rank one is broken")
    t = torch.ones(4)
    dist.all_reduce(t)  # blocks: rank 1 never joins
    time.sleep(60)


def fail_on_rank1(how: str, pid_dir: str) -> None:
    write_pid(pid_dir)
    if rank() == 1:
        time.sleep(0.2)
        if how == "exit3":
            sys.exit(3)
        if how == "os_exit7":
            os._exit(7)
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "segfault":
            import ctypes

            ctypes.string_at(0)
        if how == "badinit":

            class NeedsArgs(Exception):
                def __init__(self, a, b):
                    super().__init__(f"needs {a} and {b}")

            raise NeedsArgs(1, 2)
        if how == "unpicklable_result":
            import threading

            return threading.Lock()  # type: ignore[return-value]
    time.sleep(60)


def _mp_child() -> None:
    time.sleep(60)


def grandchildren_then_fail(pid_dir: str) -> None:
    import multiprocessing
    import subprocess

    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    write_pid(pid_dir, f"sub{rank()}-{p.pid}")
    with open(os.path.join(pid_dir, f"sub{rank()}.{p.pid}"), "w"):
        pass
    ctx = multiprocessing.get_context("spawn")
    child = ctx.Process(target=_mp_child, daemon=False)
    child.start()
    with open(os.path.join(pid_dir, f"mp{rank()}.{child.pid}"), "w"):
        pass
    write_pid(pid_dir)
    if rank() == 1:
        time.sleep(1.0)
        raise RuntimeError("failed after starting grandchildren")
    time.sleep(60)


def sleeper(pid_dir: str, seconds: float = 60) -> None:
    write_pid(pid_dir)
    time.sleep(seconds)


def slow_to_stop(pid_dir: str) -> None:
    """Sleep, deaf to SIGTERM: the teardown takes the whole grace period (then SIGKILL)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    write_pid(pid_dir)
    time.sleep(60)


def big_return(mb: int) -> bytes:
    return bytes([rank()]) * (mb << 20)


def progress_bar() -> int:
    for i in range(0, 101, 20):
        sys.stdout.write(f"\r{i:3d}%|")
        sys.stdout.flush()
        time.sleep(0.01)
    sys.stdout.write("\n")
    return rank()


def escaped_grandchild_then_fail(pid_dir: str) -> None:
    import subprocess

    # a new session: outside the rank's process group, reparented to init when the rank dies
    p = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True
    )
    with open(os.path.join(pid_dir, f"setsid{rank()}.{p.pid}"), "w"):
        pass
    write_pid(pid_dir)
    if rank() == 1:
        time.sleep(0.5)
        os._exit(5)
    time.sleep(60)


def fails_while_peer_all_reduces(pid_dir: str) -> None:
    """Rank 1 raises; rank 0, blocked in ``all_reduce``, then fails with gloo's echo of it
    ("Connection closed by peer"). Rank 0 ignores SIGTERM, so the teardown's first signal
    cannot end it before its traceback is written."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    write_pid(pid_dir)
    if rank() == 1:
        time.sleep(0.3)
        raise ValueError("rank one is broken")
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    dist.all_reduce(torch.ones(4))
    time.sleep(60)


def with_a_thread_of_its_own(flag: str) -> int:
    """The user's code runs a thread of its own beside the main one until ``flag`` exists;
    each rank reports steps meanwhile (so the caller knows both are in their loop)."""
    import threading

    import gangrun

    def user_helper() -> None:
        while not os.path.exists(flag):
            time.sleep(0.02)

    t = threading.Thread(target=user_helper, name="user-helper", daemon=True)
    t.start()
    step = 0
    while not os.path.exists(flag):
        step += 1
        gangrun.report_step(step)
        time.sleep(0.02)
    t.join(10)
    return rank()


def talk(tag: str, flags: str, other: str) -> int:
    """Print ``<tag> before``, then wait (at most 60 s) until this call's and the ``other``
    call's ranks have all started, then print ``<tag> during`` lines."""
    print(f"{tag} before", flush=True)
    write_pid(flags, f"{tag}{rank()}")
    deadline = time.monotonic() + 60
    names = [f"{t}{r}." for t in (tag, other) for r in range(int(os.environ["WORLD_SIZE"]))]
    while time.monotonic() < deadline:
        here = os.listdir(flags)
        if all(any(h.startswith(n) for h in here) for n in names):
            break
        time.sleep(0.02)
    for i in range(3):
        print(f"{tag} during {i}", flush=True)
        time.sleep(0.05)
    return rank()
