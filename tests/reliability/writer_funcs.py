"""Rank functions of the one-writer tests (tests/reliability/test_one_writer.py): a module of
their own, importing only the standard library at the top (ranks import it)."""

from __future__ import annotations

import os
import time


def _wait(path: str, limit: float = 90.0) -> None:
    deadline = time.monotonic() + limit
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def counts(
    total: int, gate: str | None = None, at: int = 0, die_at: int = -1, marker: str = ""
) -> dict:
    """A Checkpointer on the call's checkpoint_dir (every step saved): ``w`` counts the steps
    done. With ``gate``: once ``at`` steps are done and saved, says so (``<gate>.reached``)
    and waits for ``gate``. With ``marker``: the rank SIGKILLs itself once (the marker says
    it did) when ``die_at`` steps are done. Returns where it started and the final count."""
    import signal

    import torch
    import torch.distributed as dist

    import gangrun

    dist.init_process_group("gloo")
    state = {"w": torch.zeros(1)}
    ckpt = gangrun.Checkpointer(state, every=1, async_save=False)
    start = ckpt.restore()
    for step in ckpt.steps(total):
        if marker and step == die_at and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        if gate and step == at:  # steps 0..at-1 are done and saved (sync saves)
            open(f"{gate}.reached", "w").close()
            _wait(gate)
        state["w"] += 1
    return {"start": start, "w": float(state["w"][0]), "from": ckpt.restored_from}


def two_managers(where: str) -> str:
    """Two Checkpointers on one location in one function."""
    import torch
    import torch.distributed as dist

    import gangrun

    dist.init_process_group("gloo")
    first = gangrun.Checkpointer({"a": torch.zeros(1)}, dir=where)
    second = gangrun.Checkpointer({"b": torch.zeros(1)}, dir=where + "/")  # the same location
    return f"both made: {first.dir}, {second.dir}"


def one_after_another(where: str) -> int:
    """A manager closed, then another on the same location: fine."""
    import torch
    import torch.distributed as dist

    import gangrun

    dist.init_process_group("gloo")
    with gangrun.Checkpointer({"a": torch.zeros(1)}, dir=where) as first:
        first.step = 3
        first.save()
    second = gangrun.Checkpointer({"a": torch.zeros(1)}, dir=where)
    return second.restore()


def location_then_wait(gate: str) -> str:
    """Waits for ``gate``; returns the checkpoint location the rank was given."""
    from gangrun.wire import contract

    _wait(gate)
    return os.environ.get(contract.CHECKPOINT_DIR, "")


def location_then_fail(gate: str) -> str:
    """Waits for ``gate``, then fails naming the checkpoint location the rank was given (the
    MLflow run ends FAILED, with the error tags a resume clears)."""
    from gangrun.wire import contract

    _wait(gate)
    raise RuntimeError(f"stops here; location={os.environ.get(contract.CHECKPOINT_DIR)!r}")


def saves_then_fails(total: int) -> None:
    """A Checkpointer saving every step (a tensor, so each checkpoint has a data file), the
    step's loss logged through it; then the function raises (the MLflow run ends FAILED)."""
    import torch
    import torch.distributed as dist

    import gangrun

    dist.init_process_group("gloo")
    state = {"w": torch.zeros(4)}
    ckpt = gangrun.Checkpointer(state, every=1, keep=2, async_save=False)
    for step in ckpt.steps(total):
        state["w"] += 1
        ckpt.log_metrics({"loss": 1.0 / (step + 1)}, step)
    raise RuntimeError(f"the first failure, after {total} steps")
