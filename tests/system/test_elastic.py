"""Resume on another number of ranks (docs/long_runs.md, "Another number of GPUs").

The seed's loop with ``gangrun.data.DistributedSampler`` and the global batch held trains on
2 ranks (gloo, CPU), stops at a drawn step (a call with fewer total steps: it saves there,
mid-epoch or at an epoch's end), and another call continues it on 1, on 3 and on 2 ranks
(DDP), or on 1 rank and then again on 2 (FSDP2: 2 -> 1 -> 2). Shown: every sample of each
epoch is read exactly once across the worlds that read it; an epoch a call begins is what its
number of ranks reads uninterrupted (torch's own sampler); the model and optimizer after the
restore are bitwise the saved full state; every step's loss is within 1e-6 (relative) of the
uninterrupted run's on 2 ranks; the resume onto another size says so in one line on rank 0's
stderr. At the same size the resume is bitwise the uninterrupted run.
"""

from __future__ import annotations

import os
import random
import shutil

import elasticfns as ef
import pytest

import gangrun

torch = pytest.importorskip("torch")
from torch.utils.data import DistributedSampler  # noqa: E402

pytestmark = pytest.mark.slow

STEPS = ef.EPOCHS * ef.N // ef.GLOBAL_BATCH  # 8


def _call(processes, where, total, framework):
    run = gangrun.distributed(
        processes=processes, timeout=120, output="rank0", checkpoint_dir=where
    )(ef.train)
    return run.distributed(framework, total)


def _equal(a, b, where=""):
    """Bitwise equality of nested state dicts."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


_base: dict[str, dict] = {}


def _baseline(framework, tmp_path_factory):
    if framework not in _base:
        out = _call(2, str(tmp_path_factory.mktemp("base")), STEPS, framework)
        assert sorted(out[0]["losses"]) == list(range(STEPS))
        _base[framework] = out[0]["losses"]
    return _base[framework]


def _check(calls, stops, base, said, exact=False):
    """``calls[i]`` ran steps ``stops[i-1]`` to ``stops[i]``, each continuing the one before on
    its own number of ranks."""
    for prev, out, stop in zip(calls[:-1], calls[1:], stops, strict=True):
        # the model and optimizer after the restore: bitwise the saved full state
        assert out[0]["start"] == stop
        _equal(out[0]["restored"][0], prev[0]["model"], "model")
        _equal(out[0]["restored"][1], prev[0]["optim"], "optim")
        old, new = len(prev), len(out)
        epoch = (stop * ef.GLOBAL_BATCH - 1) // ef.N  # the epoch the stopped call was in
        line = (
            f"gangrun: resumed step {stop} saved by {old} ranks onto {new}: model and "
            "optimizer resharded, data at global sample "
            f"{stop * ef.GLOBAL_BATCH - epoch * ef.N} of epoch {epoch}"
        )
        assert (line in said) == (old != new), said
    # each epoch: every sample exactly once across the worlds that read it; an epoch a call
    # began is what its number of ranks reads uninterrupted (torch's own sampler)
    for e in range(ef.EPOCHS):
        ids = [i for out in calls for r in out for i in r["reads"].get(e, [])]
        assert sorted(ids) == list(range(ef.N)), f"epoch {e}"
    for out, stop in zip(calls, [0, *stops], strict=True):
        for e in range(-(-stop * ef.GLOBAL_BATCH // ef.N), ef.EPOCHS):
            for r in out:
                s = DistributedSampler(range(ef.N), len(out), r["rank"], seed=ef.SEED)
                s.set_epoch(e)
                got = r["reads"].get(e, [])
                assert got == list(s)[: len(got)], f"epoch {e} on {len(out)} ranks"
    # every step's loss, against the uninterrupted run on 2 ranks
    losses = {k: v for out in calls for k, v in out[0]["losses"].items()}
    assert sorted(losses) == list(range(STEPS))
    for step, loss in losses.items():
        if exact:
            assert loss == base[step], f"step {step}"
        else:
            assert loss == pytest.approx(base[step], rel=1e-6, abs=0), f"step {step}"


def test_ddp_resumed_on_1_and_on_3_ranks_and_on_2_bitwise(tmp_path, tmp_path_factory, capfd):
    base = _baseline("ddp", tmp_path_factory)
    stop = random.Random(os.urandom(8)).randrange(1, STEPS - 1)
    print(f"the first call stops after step {stop}")
    where = str(tmp_path / "ckpt")
    first = _call(2, where, stop, "ddp")
    for new in (1, 3, 2):
        again = str(tmp_path / f"on{new}")
        shutil.copytree(where, again)
        capfd.readouterr()
        second = _call(new, again, STEPS, "ddp")
        _check([first, second], [stop], base, capfd.readouterr().err, exact=new == 2)


def test_fsdp2_resumed_2_to_1_to_2_ranks(tmp_path, tmp_path_factory, capfd):
    base = _baseline("ddp", tmp_path_factory)  # the same arithmetic: within 1e-6 of it too
    rnd = random.Random(os.urandom(8))
    first = rnd.randrange(1, STEPS - 2)
    stops = [first, rnd.randrange(first + 1, STEPS - 1)]
    print(f"the calls stop after steps {stops}")
    where = str(tmp_path / "ckpt")
    capfd.readouterr()
    calls = [_call(n, where, s, "fsdp2") for n, s in ((2, stops[0]), (1, stops[1]), (2, STEPS))]
    _check(calls, stops, base, capfd.readouterr().err)


def _data(kind, root):
    """The ids of a table (120 rows, row groups of 17) or a volume (30 one-id files)."""
    os.makedirs(root)
    if kind == "table":
        import pyarrow as pa
        import pyarrow.parquet as pq

        for f in range(3):
            ids = list(range(f * 40, (f + 1) * 40))
            pq.write_table(pa.table({"id": ids}), f"{root}/p{f}.parquet", row_group_size=17)
        return list(range(120)), 12  # 2 ranks x 5 rows: 12 steps an epoch
    for i in range(30):
        with open(f"{root}/f{i:02d}.json", "w") as f:
            f.write(str(i))
    return list(range(30)), 5  # 2 ranks x 3 files: 5 steps an epoch


def _fresh_epoch(kind, root, world, epoch, workers):
    """Each rank's ids of ``epoch`` read uninterrupted by ``world`` ranks (in this process)."""
    from gangrun.data import TableDataset, VolumeDataset

    out = []
    for r in range(world):
        if kind == "table":
            ds = TableDataset(
                root,
                batch_size=5,
                shuffle=True,
                seed=ef.SEED,
                shuffle_buffer=37,
                rank=r,
                world_size=world,
            )
            loader = ds.loader(num_workers=workers)
        else:
            ds = VolumeDataset(
                root, shuffle=True, seed=ef.SEED, decode=ef.json_ids, rank=r, world_size=world
            )
            loader = ds.loader(batch_size=3, num_workers=workers)
        ds.set_epoch(epoch)
        ids = [int(i) for b in loader for i in (b["id"] if isinstance(b, dict) else b).tolist()]
        out.append(ids)
    return out


@pytest.mark.parametrize("kind,workers", [("table", 2), ("volume", 1)])
def test_dataset_loader_resumed_on_1_and_on_3_ranks(tmp_path, capfd, kind, workers):
    # a TableDataset / VolumeDataset loader (DataLoader workers) saved mid-epoch by 2 ranks:
    # continued on 1 and on 3, every id of the interrupted epoch is read once across both
    # worlds (but the new world's pad of the rest to equal shares: fewer than `new` ids twice),
    # the next epoch is what the new size reads uninterrupted, the model and optimizer
    # restore bitwise, and the cell says where the data continues
    root = str(tmp_path / "data")
    ids, per_epoch = _data(kind, root)
    stop = random.Random(os.urandom(8)).randrange(1, per_epoch)  # mid epoch 0
    print(f"the first call stops after step {stop}")
    where = str(tmp_path / "ckpt")
    run = gangrun.distributed(processes=2, timeout=120, output="rank0", checkpoint_dir=where)
    first = run(ef.train_data).distributed(kind, root, 2, stop, workers)
    for new in (1, 3):
        again = str(tmp_path / f"on{new}")
        shutil.copytree(where, again)
        capfd.readouterr()
        go = gangrun.distributed(processes=new, timeout=120, output="rank0", checkpoint_dir=again)
        second = go(ef.train_data).distributed(kind, root, 2, 10**6, workers)
        said = capfd.readouterr().err
        assert second[0]["start"] == stop
        _equal(second[0]["restored"][0], first[0]["model"], "model")
        _equal(second[0]["restored"][1], first[0]["optim"], "optim")
        read = [i for out in (first, second) for r in out for i in r["reads"].get(0, [])]
        assert sorted(set(read)) == ids, f"an id of the interrupted epoch was not read ({new})"
        twice = [i for i in set(read) if read.count(i) > 1]
        assert max(read.count(i) for i in ids) <= 2 and len(twice) <= new - 1, twice
        assert [r["reads"][1] for r in second] == _fresh_epoch(kind, root, new, 1, workers)
        assert f"saved by 2 ranks onto {new}" in said and "rest of epoch 0" in said, said


def _held_epoch(kind, root, world, epoch, workers):
    """Each rank's ids of ``epoch`` read uninterrupted by ``world`` ranks, the global batch
    held, and the global batches (sorted ids) they make together."""
    per = []
    for r in range(world):
        ds = ef.held_dataset(kind, root, r, world)
        loader = ds.loader(num_workers=workers)
        ds.set_epoch(epoch)
        per.append(
            [[int(i) for i in (b["id"] if isinstance(b, dict) else b).tolist()] for b in loader]
        )
    ids = [[i for b in batches for i in b] for batches in per]
    return ids, [sorted(i for p in per for i in p[k]) for k in range(len(per[0]))]


@pytest.mark.parametrize("kind", ["table", "volume"])
def test_global_batch_held_resumed_on_1_and_on_3_ranks(tmp_path, capfd, kind):
    # a TableDataset / VolumeDataset loader with global_batch_size (2 DataLoader workers per
    # rank) saved by 2 ranks at a drawn step: continued on 1 and on 3 ranks, every step's
    # loss is within 1e-6 of the uninterrupted run on 2 (global batch k is the same samples),
    # every sample of the interrupted epoch is read once, the next epoch is what the new
    # size reads uninterrupted, the model and optimizer restore bitwise
    root = str(tmp_path / "data")
    ids, _ = _data(kind, root)
    g, _ = ef.HELD[kind]
    per_epoch = len(ids) // g
    steps = 2 * per_epoch
    base_dir = str(tmp_path / "base")
    run = gangrun.distributed(processes=2, timeout=120, output="rank0", checkpoint_dir=base_dir)
    base = run(ef.train_held).distributed(kind, root, 2, steps, 2)[0]["losses"]
    assert sorted(base) == list(range(steps))
    stop = random.Random(os.urandom(8)).randrange(1, per_epoch)  # mid epoch 0
    print(f"the first call stops after step {stop}")
    where = str(tmp_path / "ckpt")
    run = gangrun.distributed(processes=2, timeout=120, output="rank0", checkpoint_dir=where)
    first = run(ef.train_held).distributed(kind, root, 2, stop, 2)
    for new in (1, 3):
        again = str(tmp_path / f"on{new}")
        shutil.copytree(where, again)
        capfd.readouterr()
        go = gangrun.distributed(processes=new, timeout=120, output="rank0", checkpoint_dir=again)
        second = go(ef.train_held).distributed(kind, root, 2, steps, 2)
        said = capfd.readouterr().err
        assert second[0]["start"] == stop
        _equal(second[0]["restored"][0], first[0]["model"], "model")
        _equal(second[0]["restored"][1], first[0]["optim"], "optim")
        read = [i for out in (first, second) for r in out for i in r["reads"].get(0, [])]
        assert sorted(read) == ids, f"epoch 0 across 2 and {new} ranks"
        fresh, _ = _held_epoch(kind, root, new, 1, 2)
        assert [r["reads"][1] for r in second] == fresh
        losses = {**first[0]["losses"], **second[0]["losses"]}
        assert sorted(losses) == list(range(steps))
        for step, loss in losses.items():
            assert loss == pytest.approx(base[step], rel=1e-6, abs=0), f"step {step} on {new}"
        assert f"saved by 2 ranks onto {new}" in said and f"global batch {stop} of" in said, said


@pytest.mark.parametrize("kind", ["table", "volume"])
def test_global_batch_held_the_same_on_any_world_and_worker_count(tmp_path, kind):
    # real DataLoader worker processes: global batch k is the same set of samples on 1, 2, 3
    # and 6 ranks with 0 to 3 workers each, and an epoch reads every sample once
    root = str(tmp_path / "data")
    ids, _ = _data(kind, root)
    _, ref = _held_epoch(kind, root, 2, 0, 2)
    assert sorted(i for b in ref for i in b) == ids
    for world, workers in ((1, 0), (1, 3), (3, 1), (3, 2), (6, 0), (6, 3)):
        assert _held_epoch(kind, root, world, 0, workers)[1] == ref, (world, workers)
    with pytest.raises(ValueError, match="world size 4 does not divide lanes=6"):
        ef.held_dataset(kind, root, 0, 4)
