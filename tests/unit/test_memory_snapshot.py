"""Memory snapshots without a gang: the slot format (a torn slot is not complete, a damaged one
is refused), the flattening of a state dict (read back bitwise), the double buffer, and the
keeper (its directory lives as long as its caller, however the caller ends).

The keeper is a real process, and the callers killed here are real processes too.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from gangrun.checkpoint import snapshots as flat_io
from gangrun.host import keeper
from gangrun.rank.snapshots import MemorySnapshots, choose
from gangrun.wire import snapshot as slot_file

torch = pytest.importorskip("torch")


def _leftovers(call_id: str) -> list[str]:
    return [n for n in os.listdir(keeper.SHM) if call_id in n]


@pytest.fixture
def kept():
    call_id = f"test-{uuid.uuid4().hex[:10]}"
    k = keeper.start(call_id)
    yield k
    k.stop()
    assert _leftovers(call_id) == []


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(6, 5, generator=g)
    return {
        "model": {"w": w, "wt": w.t(), "b": torch.randn(5, generator=g).bfloat16()},
        "optim": {
            "state": {
                "w": {"step": torch.tensor(float(seed)), "exp_avg": torch.randn(6, 5, generator=g)}
            },
            "param_groups": [{"lr": 0.1, "params": ["w"], "betas": (0.9, 0.99)}],
        },
        "mask": torch.rand(7, generator=g) > 0.5,
        "empty": torch.empty(0, 3, dtype=torch.int64),
        "z": torch.tensor([1 + 2j], dtype=torch.complex64),
        "__gangrun_rank0": b"\x00blob" * 10,
    }


def _same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert a.contiguous().view(-1).view(torch.uint8).equal(b.reshape(-1).view(torch.uint8))
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    else:
        assert a == b


def test_flatten_and_unflatten_are_bitwise():
    sd = _state(1)
    flat = flat_io.flatten(sd)
    data = torch.zeros(flat.data_len, dtype=torch.uint8)
    flat_io.copy_into(flat, data)
    fill = lambda dst, off: dst.copy_(data[off : off + len(dst)])  # noqa: E731
    back = flat_io.unflatten(flat.meta, fill)
    _same(sd, back)
    data.zero_()  # nothing restored aliases the slot
    assert back["model"]["w"].equal(sd["model"]["w"])
    # read into the state's own tensors where they fit (dtype, shape), fresh ones elsewhere
    own = {"model": {"w": torch.zeros(6, 5), "b": torch.zeros(3)}}
    flat_io.copy_into(flat, data)
    into = flat_io.unflatten(flat.meta, fill, own)
    assert into["model"]["w"] is not sd["model"]["w"] and own["model"]["w"].equal(sd["model"]["w"])
    assert into["model"]["w"].data_ptr() == own["model"]["w"].data_ptr()
    assert own["model"]["b"].equal(torch.zeros(3)) and into["model"]["b"].dtype == torch.bfloat16


def test_a_sharded_tensor_is_refused_by_name():
    class Sharded(torch.Tensor):
        pass

    t = torch.zeros(2).as_subclass(Sharded)
    with pytest.raises(flat_io.Unsupported, match=r"model\['w'\]"):
        flat_io.flatten({"model": {"w": t}})


def test_header_round_trip_torn_and_another_version():
    h = slot_file.SlotHeader(1, 2, 300, 10, 7, 4096, 9, 1.5)
    buf = bytearray(slot_file.HEADER)
    slot_file.commit(buf, h)
    assert slot_file.read_header(buf) == h
    torn = bytearray(buf)
    torn[20] ^= 0xFF  # a header half written: its own checksum fails
    assert slot_file.read_header(torn) is None
    slot_file.invalidate(buf)
    assert slot_file.read_header(buf) is None


def _snap(root: str, rank: int = 0, world: int = 1, cap: int = 1 << 30) -> MemorySnapshots:
    return MemorySnapshots(root, rank, world, 1, cap)


def test_double_buffer_keeps_a_complete_slot_and_verifies(kept):
    mem = _snap(kept.path)
    for step in (1, 2, 3):
        mem.take(step, lambda s=step: _state(s))
    mem.wait()
    assert sorted(mem.complete()) == [2, 3]
    # a snapshot of step 4 killed mid-copy: the older slot's header is zeroed first
    older = mem.complete()[2]
    with open(slot_file.slot_path(kept.path, 0, older), "r+b") as f:
        f.write(bytes(64))
        f.seek(slot_file.HEADER + 3)
        f.write(b"garbage")
    again = _snap(kept.path)  # the rank forked again
    assert again.complete() == {3: 1 - older}
    got = choose(again, storage_step=None, gather=lambda v: [v])
    assert got is not None and got[0] == 3
    _same(_state(3), got[1])
    # the restore invalidated the other slot: no step of another timeline comes back
    assert _snap(kept.path).complete() == {3: 1 - older}
    mem.close()
    again.close()


def test_a_damaged_slot_is_refused_and_storage_wins_when_newer(kept, capsys):
    mem = _snap(kept.path)
    mem.take(5, lambda: _state(5))
    mem.wait()
    j = mem.complete()[5]
    path = slot_file.slot_path(kept.path, 0, j)
    with open(path, "rb") as f:
        h = slot_file.read_header(f.read(slot_file.HEADER))
    assert h is not None
    with open(path, "r+b") as f:  # one bit flipped in the data, the size unchanged
        f.seek(slot_file.data_offset(h.meta_len) + 11)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 1]))
    fresh = _snap(kept.path)
    assert "checksum" in str(fresh.check(5, j))
    assert choose(fresh, storage_step=None, gather=lambda v: [v]) is None
    assert "cannot be restored" in capsys.readouterr().err
    # a storage checkpoint newer than every snapshot: storage
    mem2 = _snap(kept.path)
    mem2.take(6, lambda: _state(6))
    mem2.wait()
    assert choose(_snap(kept.path), storage_step=7, gather=lambda v: [v]) is None
    mem.close()
    mem2.close()


def test_over_the_cap_one_line_and_storage_only(kept, capsys):
    mem = _snap(kept.path, world=2, cap=1000)
    mem.take(1, lambda: _state(1))
    mem.take(2, lambda: _state(2))
    err = capsys.readouterr().err
    assert err.count("memory snapshots are off") == 1 and "over the cap" in err
    assert not mem.enabled and mem.complete() == {}


def test_a_dead_keeper_means_storage_with_one_line(capsys):
    call_id = f"test-{uuid.uuid4().hex[:10]}"
    k = keeper.start(call_id)
    mem = _snap(k.path)
    mem.take(1, lambda: _state(1))
    mem.wait()
    k.proc.kill()
    k.proc.wait(10)
    assert not keeper.alive(k.path)
    assert choose(_snap(k.path), storage_step=None, gather=lambda v: [v]) is None
    assert "keeper" in capsys.readouterr().err
    mem.close()
    assert k.path in keeper.sweep()
    assert _leftovers(call_id) == []
    k.stop()


CALLER = """
import sys, time
from gangrun.host import keeper
k = keeper.start(sys.argv[1])
open(k.path + "/rank0.slot0", "wb").write(b"x" * 4096)
print(k.path, k.proc.pid, flush=True)
time.sleep(60)
"""


def test_a_killed_caller_leaves_nothing_in_dev_shm():
    call_id = f"test-{uuid.uuid4().hex[:10]}"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen(
        [sys.executable, "-c", CALLER, call_id], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        line = proc.stdout.readline().split()
        assert line, "the caller did not start its keeper"
        path, pid = line[0], int(line[1])
        assert os.path.exists(path)
        os.kill(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while (_leftovers(call_id) or _lives(pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _leftovers(call_id) == [] and not _lives(pid)
    finally:
        proc.kill()
        proc.wait(10)


def _lives(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_the_options_are_checked():
    from gangrun.errors import LaunchError
    from gangrun.options import Options

    assert Options(processes=1).memory is True and Options(processes=1).memory_every is None
    with pytest.raises(LaunchError, match="memory_every must be >= 1"):
        Options(processes=1, memory_every=0).validate()
    with pytest.raises(LaunchError, match="memory must be True or False"):
        Options(processes=1, memory="yes").validate()  # type: ignore[arg-type]


def test_the_keeper_starts_only_for_a_call_that_can_restore(capsys):
    from gangrun.lifecycle import snapshots as caller_side
    from gangrun.options import Options
    from gangrun.wire import contract

    ckpt = {contract.CHECKPOINT_DIR: "/somewhere"}
    on = Options(processes=2, max_restarts=1, memory_every=3).validate()
    for opts, env, ray in (
        (Options(processes=2, max_restarts=1, memory=False).validate(), ckpt, False),
        (Options(processes=2).validate(), ckpt, False),  # no restart: nothing would restore
        (on, {}, False),  # no checkpoints
        (on, ckpt, True),  # backend ray
    ):
        assert caller_side.start(opts, "x", env, ray) == (None, {})
    call_id = f"test-{uuid.uuid4().hex[:10]}"
    k, env = caller_side.start(on, call_id, ckpt, False)
    try:
        assert k is not None and env[contract.MEMORY_DIR] == k.path and keeper.alive(k.path)
        assert env[contract.MEMORY_EVERY] == "3" and int(env[contract.MEMORY_CAP]) > 0
    finally:
        caller_side.stop(k)
    assert _leftovers(call_id) == [] and not k.running()


def test_a_tensor_larger_than_a_chunk_is_read_back_bitwise(kept):
    big = torch.randn((slot_file.CHUNK * 5 // 4) // 4, generator=torch.Generator().manual_seed(3))
    sd = {"model": {"big": big, "small": torch.arange(5)}}
    mem = _snap(kept.path)
    mem.take(7, lambda: sd)
    mem.wait()
    own = {"model": {"big": torch.zeros_like(big)}}  # read into the state's own tensor
    got = choose(_snap(kept.path), None, lambda v: [v], lambda: own)
    assert got is not None and got[0] == 7
    assert own["model"]["big"].equal(big) and got[1]["model"]["small"].equal(torch.arange(5))
    mem.close()
