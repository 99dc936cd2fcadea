"""Rank-side fault injection for the soak (stdlib only: imported by rank processes too).

``soak_rank(plan)`` is the distributed function of every soak run. ``plan`` says which rank is
the victim, at which point of its work it fails, and how:

points: ``startup`` (first thing), ``print`` (after printing heavily), ``checkpoint`` (in the
middle of writing a checkpoint file), ``return`` (while its large return value is being
pickled), ``before_init`` (torch imported, before ``init_process_group``), ``collective``
(peers blocked inside a gloo collective; signal kinds fire while the victim itself is inside a
gloo ``recv``).

kinds: ``exception``, ``exit`` (``sys.exit(code)``; ``os._exit(code)`` where no Python frame
can raise), ``sigkill``, ``sigsegv``, ``hang``; and for caller-side faults (``interrupt``,
``cancel``, ``caller_kill``, ``caller_forks``) no rank fails: every rank does its work and
then waits.

Outage kinds: ``tracking_killed`` (the call's MLflow tracking server is SIGKILLed
while the ranks log metrics: they keep training, the results come back at once) and
``disk_full`` (the run directory is on a small tmpfs: the victim's result does not fit
(point ``result``), or it fills the disk and raises (``record``: no room for its error
record), or the payload itself does not fit (``payload``)).

Hang-verdict kinds (point ``verdict``, `verdict_rank`): one per kind of hang the verdict names
(``hang_skipped``, ``hang_reordered``, ``hang_mismatched``, ``hang_dataloader``, ``hang_lock``,
``hang_init``, ``hang_stopped``: the victim holds the others) and healthy ones it must leave
alone (``busy_barrier``: the victim computes while the others wait at a barrier,
``asleep_outside``: every rank sleeps outside any collective, ``slow_reader``: the victim reads
a file slowly while the others wait, ``slow_loader``: its DataLoader is slow but moving).

Scenario kinds (no ``point``): ``long_line`` (the victim writes a long line without a newline,
then raises), ``native_printf`` (every rank prints through C ``printf``, which must arrive),
``concurrent_env`` (two calls at once with different start-up environments: both succeed),
and ``early_exit0`` (the victim exits 0 without a result while its peers run: it must be the
root cause).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time

RANK_KINDS = ("exception", "exit", "sigkill", "sigsegv", "hang")
CALLER_KINDS = ("interrupt", "cancel", "caller_kill", "caller_forks")
SCENARIO_KINDS = ("long_line", "native_printf", "concurrent_env", "early_exit0", "resume")
OUTAGE_KINDS = ("tracking_killed", "disk_full")
DISK_POINTS = ("result", "record", "payload")
VERDICT_KINDS = (
    "hang_skipped", "hang_reordered", "hang_mismatched", "hang_dataloader", "hang_lock",
    "hang_init", "hang_stopped",
)  # fmt: skip
HEALTHY_KINDS = ("busy_barrier", "asleep_outside", "slow_reader", "slow_loader")
VERDICT_T = 2.0  # the hang_timeout of the verdict kinds
OPTIONAL_KINDS: tuple[str, ...] = ()  # kinds drawn only when named in GANGRUN_SOAK_KINDS
CHEAP_POINTS = ("startup", "print", "checkpoint", "return")
TORCH_POINTS = ("before_init", "collective")


class SoakFault(Exception):
    """The exception the soak injects."""


def fault(kind: str, code: int, main_thread: bool = True) -> None:
    if kind == "exception":
        raise SoakFault(f"injected fault in rank {os.environ.get('RANK')}")
    if kind == "exit":
        if main_thread:
            sys.exit(code)
        sys.stdout.flush()
        os._exit(code)
    if kind == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "sigsegv":
        if code % 2:
            ctypes.string_at(0)  # a real invalid read in native code
        os.kill(os.getpid(), signal.SIGSEGV)
    if kind == "hang":
        while True:
            time.sleep(3600)
    time.sleep(30)  # a signal on its way


class Bomb:
    """Goes off while the rank's return value is being pickled."""

    def __init__(self, kind: str, code: int) -> None:
        self.kind, self.code = kind, code

    def __reduce__(self):  # type: ignore[override]
        fault(self.kind, self.code, main_thread=False)
        return (Bomb, (self.kind, self.code))


def _spawn_child(setsid: bool) -> None:
    subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)"],
        start_new_session=setsid,
        stdin=subprocess.DEVNULL,
    )


def _wait_forever() -> None:
    while True:
        time.sleep(3600)


def native_marker(plan: dict, rank: int) -> str:
    return f"soak-native seed {plan['seed']} rank {rank}"


def _scenario(plan: dict, rank: int, me: bool) -> object:
    kind = plan["kind"]
    if kind == "long_line":
        if me:
            sys.stdout.write("y" * plan["long"])
            sys.stdout.flush()
            fault("exception", plan["code"])
        _wait_forever()
    if kind == "native_printf":
        libc = ctypes.CDLL(None)
        marker = native_marker(plan, rank).encode()
        libc.printf(b"%s line\n", marker)
        libc.printf(b"%s tail", marker)  # no newline: flushed at the rank's exit
        return rank
    if kind == "concurrent_env":
        time.sleep(plan["delay"] / 2)
        return [rank, os.environ.get("PYTHONHASHSEED")]
    if kind == "early_exit0":
        if me:
            time.sleep(plan["delay"] / 4)
            sys.stdout.flush()
            os._exit(0)
        _wait_forever()
    raise AssertionError(f"unknown scenario {kind}")


def _wait_file(path: str, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise SoakFault(f"{path} never appeared")
        time.sleep(0.02)


def _outage(plan: dict, rank: int, me: bool) -> object:
    if plan["kind"] == "tracking_killed":
        import mlflow

        flags = plan["flags"]
        mlflow.log_metric(f"loss{rank}", 1.0, step=0)
        mlflow.flush_async_logging()
        open(os.path.join(flags, f"logged.{rank}"), "w").close()
        _wait_file(os.path.join(flags, "killed"))
        end, step = time.monotonic() + plan["delay"], 1
        while time.monotonic() < end:  # training goes on, logging every step
            mlflow.log_metric(f"loss{rank}", 1.0 / (step + 1), step=step)
            step += 1
            time.sleep(0.02)
        return rank
    if me and plan["point"] == "result":
        return b"r" * plan["fill"]  # more than the disk holds
    if me and plan["point"] == "record":
        with open(os.path.join(os.environ["GANGRUN_RUN_DIR"], "filler"), "wb") as f:
            try:
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            except OSError:
                pass
        raise SoakFault("no room left " + "x" * 200000)  # its record cannot fit
    if plan["others"] == "sleep":
        _wait_forever()
    return rank


def soak_rank(plan: dict) -> object:
    rank = int(os.environ["RANK"])
    me = rank == plan["victim"]
    kind, code, point = plan["kind"], plan["code"], plan["point"]
    if kind in OUTAGE_KINDS:
        return _outage(plan, rank, me)
    if kind in SCENARIO_KINDS + OPTIONAL_KINDS:
        return _scenario(plan, rank, me)
    caller_side = kind in CALLER_KINDS
    if plan["child_rank"] == rank:
        _spawn_child(plan["setsid"])
    if point == "startup":
        if me and not caller_side:
            fault(kind, code)
    elif point == "print":
        line = "x" * 100
        for i in range(plan["lines"]):
            print(f"{i} {line}")
        if me and not caller_side:
            fault(kind, code)
    elif point == "checkpoint":
        path = os.path.join(plan["ckpt_dir"], f"ckpt-{plan['seed']}-{rank}.bin")
        with open(path, "wb") as f:
            for i in range(64):
                f.write(b"\0" * 65536)
                if me and not caller_side and i == plan["step"]:
                    f.flush()
                    fault(kind, code)
        os.unlink(path)
    elif point == "return":
        big = b"r" * plan["big"]
        if me and not caller_side:
            return [big, Bomb(kind, code)]
        if plan["others"] == "finish":
            return [big]
    elif point in TORCH_POINTS:
        import datetime

        import torch
        import torch.distributed as dist

        if point == "before_init" and me and not caller_side:
            fault(kind, code)
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
        t = torch.ones(4)
        for step in range(4):
            if point == "collective" and me and not caller_side and step == plan["step"]:
                if kind in ("exception", "exit", "hang"):
                    fault(kind, code)
                # the victim is blocked inside a gloo op when the fault fires from a thread
                threading.Timer(0.2, fault, (kind, code, False)).start()
                dist.recv(torch.zeros(1), src=(rank + 1) % dist.get_world_size())
            dist.all_reduce(t)
        if caller_side:
            _wait_forever()
        dist.barrier()
        return t.tolist()
    if caller_side or plan["others"] == "sleep":
        _wait_forever()
    return rank


class _Items:
    """A dataset whose items take ``pause`` seconds each; item ``block`` never comes."""

    def __init__(self, pause: float, block: int) -> None:
        self.pause, self.block = pause, block

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> object:
        import torch

        if i == self.block:
            _wait_forever()
        time.sleep(self.pause)
        return torch.ones(4)


def _slow_read(seconds: float) -> None:
    """Read a file in small pieces for ``seconds`` (little CPU, bytes moving)."""
    path = os.path.join(os.environ["GANGRUN_RUN_DIR"], "slow-read")
    with open(path, "wb") as f:
        f.write(os.urandom(1 << 20))
    end = time.monotonic() + seconds
    with open(path, "rb", buffering=0) as f:
        while time.monotonic() < end:
            if not f.read(4096):
                f.seek(0)
            time.sleep(0.01)
    os.unlink(path)


def verdict_rank(plan: dict) -> int:
    """The hang-verdict kinds (see the module)."""
    import torch
    import torch.distributed as dist

    kind, rank = plan["kind"], int(os.environ["RANK"])
    me = rank == plan["victim"]
    if kind == "hang_init" and me:
        _wait_forever()
    dist.init_process_group("gloo")
    t = torch.ones(4)
    dist.all_reduce(t)
    if kind == "hang_skipped" and me:
        _wait_forever()
    if kind == "hang_reordered":
        for op in ("broadcast", "all_reduce") if me else ("all_reduce", "broadcast"):
            dist.broadcast(t, 0) if op == "broadcast" else dist.all_reduce(t)
    if kind == "hang_mismatched":
        dist.all_reduce(torch.ones(0) if me else t)  # gloo lets the empty one through
        if me:
            _wait_forever()
    if kind == "hang_lock" and me:
        lock = threading.Lock()
        lock.acquire()
        lock.acquire()
    if kind == "hang_stopped" and me:
        os.kill(os.getpid(), signal.SIGSTOP)
    if kind in ("hang_dataloader", "slow_loader"):
        pause = VERDICT_T * 0.6 if kind == "slow_loader" and me else 0.0
        block = 2 if kind == "hang_dataloader" and me else -1
        loader = torch.utils.data.DataLoader(_Items(pause, block), batch_size=1, num_workers=1)
        for batch in loader:
            dist.all_reduce(batch)
    if kind == "busy_barrier" and me:
        end = time.monotonic() + VERDICT_T + 2
        while time.monotonic() < end:
            pass
    if kind == "asleep_outside":
        time.sleep(VERDICT_T + 1)
    if kind == "slow_reader" and me:
        _slow_read(VERDICT_T + 2)
    dist.all_reduce(t)
    dist.barrier()
    return rank


RESUME_STEPS = 12


def resume_rank(plan: dict) -> dict:
    """Soak kind ``resume``: a tiny DDP training under a Checkpointer (every 2 steps), which
    ``plan["mode"] == "kill"`` interrupts by SIGKILLing the victim once at ``kill_step``
    (after its save in flight committed); returns the final parameters."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import gangrun

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 4)
    model = DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    torch.manual_seed(1 + rank)
    ckpt = gangrun.Checkpointer({"model": model, "opt": opt}, every=2, keep=plan.get("keep", 2))
    marker = os.path.join(os.environ["GANGRUN_CALL_CHECKPOINT_DIR"], "killed")
    for step in ckpt.steps(RESUME_STEPS):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        victim = plan.get("mode") == "kill" and rank == plan["victim"]
        if victim and step == plan["kill_step"] and not os.path.exists(marker):
            open(marker, "w").close()
            ckpt.wait()
            os.kill(os.getpid(), 9)
        time.sleep(0.02)  # a preemption lands mid-training
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def ok_rank() -> int:
    return int(os.environ["RANK"])
