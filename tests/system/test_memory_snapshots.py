"""Memory snapshots (docs/long_runs.md): a rank SIGKILLed under ``max_restarts`` costs at most
one step, and the run ends bitwise where the uninterrupted run ends.

A DDP MLP on 2 gloo ranks with a `gangrun.data.DistributedSampler` loader, storage
checkpoints every 100 steps, snapshots into shared memory every step (``memory_every=1``) or
at the adaptive interval. Rank 1 is SIGKILLed inside a random step (after its update, before
``step_done``): the restart restores the memory snapshot of the step before, redoes that one
step with the same samples, and ends with the same parameters bit for bit. The snapshot
keeper SIGKILLed mid-run: one line, the restart restores storage, still exact. After each
call nothing of it is left in ``/dev/shm``, and no keeper runs.
"""

from __future__ import annotations

import os
import random
import time

import memfns
import psutil
import pytest

import gangrun
from conftest import assert_no_survivors

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.slow

TOTAL = 130


def _train(**opts):
    opts = {"processes": 2, "timeout": 240, "output": "rank0", "grace_period": 30, **opts}
    return gangrun.distributed(**opts)(memfns.train)


_base: list = []


def baseline(tmp_path_factory) -> list:
    """Every rank's result of the uninterrupted run."""
    if not _base:
        where = str(tmp_path_factory.mktemp("mem-base"))
        _base.extend(_train(checkpoint_dir=where).distributed(TOTAL))
        # every sample once per epoch: 2 ranks x 2 samples per step, 10 steps an epoch
        for epoch in range(TOTAL // 10):
            read = [
                i for r in _base for s in range(epoch * 10, epoch * 10 + 10) for i in r["seen"][s]
            ]
            assert sorted(read) == list(range(memfns.N))
    return _base


def _nothing_left(handle) -> None:
    assert not [n for n in os.listdir("/dev/shm") if handle.run_id in n]
    keepers = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "keeper.py" in cmd and handle.run_id in cmd:
            keepers.append(p.pid)
    assert keepers == []
    assert_no_survivors()


def _assert_exact(base, out) -> None:
    for k, v in base["params"].items():
        assert torch.equal(out["params"][k], v), f"parameter {k} differs after the restart"


def test_a_killed_rank_costs_one_step_from_memory(tmp_path, tmp_path_factory, capfd):
    base = baseline(tmp_path_factory)
    kill_at = random.Random(os.urandom(8)).randrange(3, TOTAL - 2)
    print(f"rank 1 is SIGKILLed inside step {kill_at}")
    handle = _train(checkpoint_dir=str(tmp_path / "ckpt"), max_restarts=1, memory_every=1).submit(
        TOTAL, kill_at=kill_at, marker=str(tmp_path / "killed")
    )
    out = handle.result()
    assert os.path.exists(tmp_path / "killed")
    for rank_out, rank_base in zip(out, base, strict=True):
        # the restart resumed at the step the kill interrupted: one step redone
        assert rank_out["start"] == kill_at
        assert rank_out["restored_from"] == f"memory:step-{kill_at:09d}"
        # the same samples, step by step, as the uninterrupted run: none skipped or read twice
        assert rank_out["seen"] == {s: rank_base["seen"][s] for s in range(kill_at, TOTAL)}
        _assert_exact(rank_base, rank_out)
    err = capfd.readouterr().err
    assert f"resumed step {kill_at} from the memory snapshot" in err
    _nothing_left(handle)


def test_every_rank_killed_at_once_costs_one_step(tmp_path, tmp_path_factory):
    base = baseline(tmp_path_factory)
    handle = _train(checkpoint_dir=str(tmp_path / "ckpt"), max_restarts=1, memory_every=1).submit(
        TOTAL, kill_at=115, kill_rank=-1, marker=str(tmp_path / "killed")
    )
    out = handle.result()
    assert [o["start"] for o in out] == [115, 115]
    for rank_out, rank_base in zip(out, base, strict=True):
        _assert_exact(rank_base, rank_out)
    _nothing_left(handle)


def test_a_second_death_right_after_the_restore(tmp_path, tmp_path_factory):
    base = baseline(tmp_path_factory)
    second = str(tmp_path / "second")
    handle = _train(checkpoint_dir=str(tmp_path / "ckpt"), max_restarts=2, memory_every=1).submit(
        TOTAL, kill_at=115, marker=str(tmp_path / "killed"), die_after_restore=second
    )
    out = handle.result()
    assert os.path.exists(second)
    assert [o["start"] for o in out] == [115, 115]  # the slot restored twice, still exact
    for rank_out, rank_base in zip(out, base, strict=True):
        _assert_exact(rank_base, rank_out)
    _nothing_left(handle)


def test_memory_is_restored_when_every_storage_checkpoint_is_damaged(
    tmp_path, tmp_path_factory, capfd
):
    base = baseline(tmp_path_factory)
    root = str(tmp_path / "ckpt")
    handle = _train(checkpoint_dir=root, max_restarts=1, memory_every=1).submit(
        TOTAL, kill_at=120, marker=str(tmp_path / "killed"), damage=root
    )
    out = handle.result()
    assert [o["start"] for o in out] == [120, 120]
    for rank_out, rank_base in zip(out, base, strict=True):
        _assert_exact(rank_base, rank_out)
    err = capfd.readouterr().err
    assert "resumed step 120 from the memory snapshot (the newest storage checkpoint: none)" in err
    _nothing_left(handle)


def test_the_adaptive_interval_still_restores_exactly(tmp_path, tmp_path_factory, capfd):
    base = baseline(tmp_path_factory)
    kill_at = 110
    handle = _train(checkpoint_dir=str(tmp_path / "ckpt"), max_restarts=1).submit(
        TOTAL, kill_at=kill_at, marker=str(tmp_path / "killed")
    )
    out = handle.result()
    start = out[0]["start"]
    assert 100 <= start <= kill_at  # memory when a snapshot is newer than step 100's save
    _assert_exact(base[0], out[0])
    assert out[1]["seen"] == {s: base[1]["seen"][s] for s in range(start, TOTAL)}
    _nothing_left(handle)


def test_a_killed_keeper_falls_back_to_storage_with_one_line(tmp_path, tmp_path_factory, capfd):
    base = baseline(tmp_path_factory)
    handle = _train(checkpoint_dir=str(tmp_path / "ckpt"), max_restarts=1, memory_every=1).submit(
        TOTAL, kill_at=120, marker=str(tmp_path / "killed"), kill_keeper_at=50
    )
    out = handle.result()
    assert out[0]["start"] == 100 and out[0]["restored_from"].endswith("step-000000100")
    _assert_exact(base[0], out[0])
    err = capfd.readouterr().err
    assert "memory snapshots are off from here (the snapshot keeper of" in err
    assert "from the memory snapshot" not in err
    _nothing_left(handle)


def test_memory_false_takes_no_snapshot(tmp_path, tmp_path_factory, capfd):
    base = baseline(tmp_path_factory)
    handle = _train(checkpoint_dir=str(tmp_path / "ckpt"), max_restarts=1, memory=False).submit(
        TOTAL, kill_at=110, marker=str(tmp_path / "killed")
    )
    out = handle.result()
    assert out[0]["start"] == 100  # storage: every step since redone
    _assert_exact(base[0], out[0])
    _nothing_left(handle)


def test_a_failed_call_leaves_nothing(tmp_path):
    handle = _train(checkpoint_dir=str(tmp_path / "ckpt"), max_restarts=1, memory_every=1).submit(
        TOTAL, raise_at=20
    )
    with pytest.raises(gangrun.DistributedError, match="failing at step 20"):
        handle.result()
    _nothing_left(handle)


CALLER = """
import sys
sys.path.insert(0, {here!r})
import gangrun, memfns
train = gangrun.distributed(processes=2, timeout=240, output="none", max_restarts=1,
                            memory_every=1)(memfns.train)
h = train.options(checkpoint_dir={where!r}).submit({total}, block_at=30, gate={gate!r})
print(h.run_id, flush=True)
h.result()
"""


def test_a_killed_caller_leaves_nothing_in_dev_shm(tmp_path, script):
    gate = str(tmp_path / "gate")
    here = os.path.dirname(os.path.abspath(__file__))
    proc = script(CALLER.format(here=here, where=str(tmp_path / "ckpt"), total=TOTAL, gate=gate))
    try:
        run_id = proc.stdout.readline().strip()
        assert run_id, proc.stderr.read() if proc.poll() is not None else "no run id"
        deadline = time.monotonic() + 120
        while not all(os.path.exists(f"{gate}.reached.{r}") for r in (0, 1)):
            assert time.monotonic() < deadline, "the ranks never reached the gate"
            time.sleep(0.05)
        held = [n for n in os.listdir("/dev/shm") if run_id in n]
        assert held, "no snapshot directory while the call runs"
        assert os.listdir(os.path.join("/dev/shm", held[0])) != []  # the slots are there
        proc.kill()
        proc.communicate(timeout=60)
        assert_no_survivors(proc.pid)  # its ranks followed it (liveness pipe)
        deadline = time.monotonic() + 30
        while [n for n in os.listdir("/dev/shm") if run_id in n]:
            assert time.monotonic() < deadline, "the snapshot directory outlived its caller"
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait(30)
