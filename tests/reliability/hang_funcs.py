"""Functions the hang-verdict tests run on every rank: each hangs in one way (the ``# at:``
comments mark the lines the verdict must name) or must not be taken for a hang."""

from __future__ import annotations

import os
import signal
import threading
import time


def _began(mark: str) -> None:
    """Write when the hang began (the test's clock for the verdict's delay)."""
    with open(mark, "w") as f:
        f.write(str(time.time()))


def _init():  # -> the torch module and torch.distributed
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")  # at: init call
    return torch, dist


def skipped(mark: str, holder: int) -> None:
    torch, dist = _init()
    dist.all_reduce(torch.ones(4))
    if dist.get_rank() == holder:
        _began(mark)
        time.sleep(600)  # at: skipped holder
    dist.all_reduce(torch.ones(4))  # at: skipped collective


def reordered(mark: str, holder: int) -> None:
    torch, dist = _init()
    dist.all_reduce(torch.ones(4))
    t = torch.ones(4)
    if dist.get_rank() == holder:
        _began(mark)
        dist.broadcast(t, 0)  # at: reordered holder
        dist.all_reduce(t)
    else:
        dist.all_reduce(t)  # at: reordered collective
        dist.broadcast(t, 0)


def mismatched(mark: str, holder: int) -> None:
    torch, dist = _init()
    dist.all_reduce(torch.ones(4))
    if dist.get_rank() == holder:
        _began(mark)
        dist.all_reduce(torch.ones(0))  # at: mismatched holder
        time.sleep(600)  # gloo let the empty one through (most size mismatches abort it)
    else:
        dist.all_reduce(torch.ones(4))  # at: mismatched collective


class Blocking:
    """A dataset whose third item never comes (its worker blocks)."""

    def __init__(self, mark: str, block: bool) -> None:
        self.mark, self.block = mark, block

    def __len__(self) -> int:
        return 100

    def __getitem__(self, i: int):
        import torch

        if self.block and i == 2:
            _began(self.mark)
            time.sleep(600)  # at: dataset getitem
        return torch.ones(4)


def dataloader(mark: str, holder: int) -> None:
    import torch

    torch_, dist = _init()
    loader = torch.utils.data.DataLoader(
        Blocking(mark, dist.get_rank() == holder), batch_size=1, num_workers=1
    )
    for batch in loader:  # at: dataloader holder
        dist.all_reduce(batch)  # at: dataloader collective


def locked(mark: str, holder: int) -> None:
    torch, dist = _init()
    lock = threading.Lock()
    lock.acquire()  # held forever by this thread: the next acquire never returns
    dist.all_reduce(torch.ones(4))
    if dist.get_rank() == holder:
        _began(mark)
        with lock:  # at: lock holder
            pass
    dist.barrier()  # at: lock collective


def never_init(mark: str, holder: int) -> None:
    if int(os.environ["RANK"]) == holder:
        _began(mark)
        time.sleep(600)  # at: init holder
    _init()


def stopped(mark: str, holder: int) -> None:
    torch, dist = _init()
    dist.all_reduce(torch.ones(4))
    if dist.get_rank() == holder:
        _began(mark)
        os.kill(os.getpid(), signal.SIGSTOP)  # at: stopped holder
    dist.all_reduce(torch.ones(4))  # at: stopped collective


def busy_rank0(seconds: float) -> int:
    """Rank 0 computes for ``seconds`` while the others wait at a barrier: not a hang."""
    torch, dist = _init()
    n = 0
    if dist.get_rank() == 0:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            n += 1
    dist.barrier()
    return n


def all_asleep(seconds: float) -> int:
    """Every rank sleeps outside any collective: not a distributed hang."""
    torch, dist = _init()
    time.sleep(seconds)
    dist.barrier()
    return dist.get_rank()


def ddp_backward(mark: str, holder: int) -> None:
    """DDP: rank ``holder`` sleeps before its third backward(); the others block in theirs
    (DDP's all-reduce runs from C++ autograd hooks: the record has the backward() line)."""
    torch, dist = _init()
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(torch.nn.Linear(4, 4))
    for step in range(3):
        loss = model(torch.randn(8, 4)).sum()
        if step == 2 and dist.get_rank() == holder:
            _began(mark)
            time.sleep(600)  # at: ddp holder
        loss.backward()  # at: ddp backward


def compiled_collective() -> list[int]:
    """torch.compile still maps the (recorded) collectives: no graph break; and eager calls
    are recorded."""
    torch, dist = _init()

    def f(x):
        y = x * 2
        dist.all_reduce(y)
        return y + 1

    explained = torch._dynamo.explain(f)(torch.ones(4))
    from gangrun.wire import collectives

    f(torch.ones(4))
    ring = collectives.read(os.environ["GANGRUN_RUN_DIR"], dist.get_rank())
    return [explained.graph_break_count, sum(r.op == "all_reduce" for r in ring.records)]
