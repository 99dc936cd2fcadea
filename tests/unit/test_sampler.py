"""gangrun.data.DistributedSampler: torch's order, one global stream resumable on any world
size, through a plain DataLoader tracked as a Checkpointer tracks it (no processes: the ranks
of a world are simulated by samplers given ``num_replicas``/``rank``)."""

from __future__ import annotations

import collections

import pytest

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402
from torch.utils.data import DistributedSampler as TorchSampler  # noqa: E402

from gangrun.checkpoint.dataloader import track  # noqa: E402
from gangrun.data import DistributedSampler, per_rank_batch  # noqa: E402
from gangrun.data.sampler import epoch_order  # noqa: E402


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [False, True])
def test_a_whole_pass_is_torchs(shuffle, drop_last):
    for n in (1, 2, 7, 12, 23):
        ds = list(range(n))
        for world in (1, 2, 3, 4):
            for epoch in (0, 3):
                for rank in range(world):
                    ours = DistributedSampler(ds, world, rank, shuffle, 5, drop_last)
                    theirs = TorchSampler(ds, world, rank, shuffle, 5, drop_last)
                    ours.set_epoch(epoch)
                    theirs.set_epoch(epoch)
                    assert list(ours) == list(theirs) and len(ours) == len(theirs)
    assert isinstance(ours, TorchSampler)  # a drop-in for code that checks


def _world_reads(n, world, position, epoch=0, drop_last=False):
    """What ``world`` ranks read of ``epoch`` when its pass starts at global ``position``."""
    out = []
    for r in range(world):
        s = DistributedSampler(list(range(n)), world, r, seed=1, drop_last=drop_last)
        s.load_state_dict({"epoch": epoch, "position": position, "len": n, "seed": 1,
                           "shuffle": True})  # fmt: skip
        out.append(list(s))
    return out


@pytest.mark.parametrize("drop_last", [False, True])
def test_resumed_on_another_world_every_sample_is_read_once(drop_last):
    n = 23
    for old in (1, 2, 3, 4):
        for c in range(0, n // old + 1):  # every rank of the old world consumed c samples
            firsts = [
                list(DistributedSampler(list(range(n)), old, r, seed=1))[:c] for r in range(old)
            ]
            done = sorted(i for f in firsts for i in f)
            pos = old * c
            order = epoch_order(n, 1, 0, True)
            assert done == sorted(order[:pos]), "the old world read the global prefix"
            for new in (1, 2, 3, 5):
                reads = _world_reads(n, new, pos, drop_last=drop_last)
                assert len({len(x) for x in reads}) == 1, "every rank reads as many"
                got = collections.Counter(done + [i for x in reads for i in x])
                rest = n - min(pos, n)
                if drop_last:
                    kept = order[: min(pos, n) + rest - rest % new]
                    assert got == collections.Counter(kept)
                else:  # each once, plus the epoch's end padded from the order's beginning
                    pad = (-rest) % new
                    assert got == collections.Counter(order + order[:pad])


def test_the_next_epoch_and_the_global_batches_are_the_new_worlds():
    n, g = 24, 6
    s = DistributedSampler(list(range(n)), 3, 1, seed=1)
    s.load_state_dict({"epoch": 2, "position": 12, "len": n, "seed": 1, "shuffle": True})
    s.set_epoch(3)  # the resumed epoch was never iterated: its start does not carry over
    theirs = TorchSampler(list(range(n)), 3, 1, seed=1)
    theirs.set_epoch(3)
    assert list(s) == list(theirs)
    # global batch k is the same set of samples on every world size holding the batch
    order = epoch_order(n, 1, 0, True)
    for world in (1, 2, 3, 6):
        b = per_rank_batch(g, world)
        shares = [list(DistributedSampler(list(range(n)), world, r, seed=1)) for r in range(world)]
        for k in range(n // g):
            batch = sorted(i for sh in shares for i in sh[k * b : (k + 1) * b])
            assert batch == sorted(order[k * g : (k + 1) * g])


def test_per_rank_batch_names_what_to_choose():
    assert per_rank_batch(12, 4) == 3
    with pytest.raises(ValueError, match=r"global batch of 10 .* over 4 ranks.*e\.g\. 20"):
        per_rank_batch(10, 4)
    with pytest.raises(ValueError, match="integer >= 1"):
        per_rank_batch(0, 1)


def _loader(world, rank, n, batch, workers=0):
    ds = TensorDataset(torch.arange(n))
    sampler = DistributedSampler(ds, world, rank, seed=3)
    loader = DataLoader(ds, batch_size=batch, sampler=sampler, num_workers=workers)
    return loader, sampler, track(loader, "loader", rank)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_tracked_loader_saves_the_global_position_and_resumes_on_another_world(workers):
    """The loader counts the batches the loop received (its workers draw indices ahead), so
    the saved position is the world's, and a world of another size continues it."""
    n, g = 24, 6
    order = epoch_order(n, 3, 1, True)
    for old, new, k in ((2, 3, 1), (2, 1, 2), (3, 2, 1), (2, 2, 3)):
        states, read = [], []
        for r in range(old):
            loader, sampler, ls = _loader(old, r, n, g // old, workers if r == 0 else 0)
            sampler.set_epoch(1)
            it = iter(loader)
            for _ in range(k):
                read += next(it)[0].tolist()
            states.append(ls.state_dict())
            del it
        assert {s["sampler"]["position"] for s in states} == {k * g}
        assert sorted(read) == sorted(order[: k * g])
        tail = [[] for _ in range(new)]
        for r in range(new):
            loader, sampler, ls = _loader(new, r, n, g // new)
            ls.load_state_dict(states[r % old])  # the rule of a restore onto another size
            sampler.set_epoch(1)
            for b in loader:
                tail[r].append(b[0].tolist())
            sampler.set_epoch(2)  # the next epoch is the new world's, whole
            assert list(sampler) == epoch_order(n, 3, 2, True)[r::new]
        assert sorted(read + [i for t in tail for b in t for i in b]) == list(range(n))
        # the global batches after the resume are the uninterrupted ones
        for j in range(n // g - k):
            got = sorted(i for t in tail for i in t[j])
            assert got == sorted(order[(k + j) * g : (k + j + 1) * g])
        if new == old:  # the same world: what it reads uninterrupted, batch for batch
            for r in range(new):
                loader, sampler, _ = _loader(new, r, n, g // new)
                sampler.set_epoch(1)
                assert [b[0].tolist() for b in loader][k:] == tail[r]


def test_a_finished_pass_resumes_at_the_next_epochs_start():
    loader, sampler, ls = _loader(2, 0, 8, 2)
    sampler.set_epoch(4)
    assert len(list(loader)) == 2
    state = ls.state_dict()
    assert not state["active"] and state["sampler"]["position"] == 0
    _, sampler2, ls2 = _loader(3, 2, 8, 2)
    ls2.load_state_dict(state)
    theirs = TorchSampler(list(range(8)), 3, 2, seed=3)
    theirs.set_epoch(4)
    assert sampler2.epoch == 4 and list(sampler2) == list(theirs)


def test_a_changed_dataset_restarts_the_epoch_with_a_warning():
    s = DistributedSampler(list(range(10)), 2, 0, seed=1)
    with pytest.warns(UserWarning, match="made for 12 samples.*restarts from its beginning"):
        s.load_state_dict({"epoch": 1, "position": 4, "len": 12, "seed": 1, "shuffle": True})
    theirs = TorchSampler(list(range(10)), 2, 0, seed=1)
    theirs.set_epoch(1)
    assert list(s) == list(theirs)


def test_torchs_sampler_resumed_on_another_world_size_is_said_not_exact():
    from torch.utils.data import DistributedSampler as TorchDS

    ds = TensorDataset(torch.arange(8))
    loader = DataLoader(ds, batch_size=2, sampler=TorchDS(ds, 2, 0, seed=1))
    ls = track(loader, "loader", 0)
    it = iter(loader)
    next(it)
    state = ls.state_dict()
    assert state["world_size"] == 1  # this process's world (no process group)
    ls.load_state_dict(state)  # the same size: skipped by count, exact, silently
    with pytest.warns(UserWarning, match=r"saved by 2 ranks resumes on 1: .*gangrun\.data\."):
        ls.load_state_dict({**state, "world_size": 2})


def test_the_environment_is_read_by_the_datasets_strict_rule(monkeypatch):
    # WORLD_SIZE without RANK (or the reverse) would make every process rank 0 of the world,
    # all reading the same share: refused, naming both variables, as the datasets do
    ds = TensorDataset(torch.arange(8))
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"DistributedSampler: WORLD_SIZE is set \(2\) but RANK"):
        DistributedSampler(ds)
    with pytest.raises(ValueError, match=r"per_rank_batch: WORLD_SIZE is set \(2\) but RANK"):
        per_rank_batch(8)
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(ValueError, match=r"RANK is set \(1\) but WORLD_SIZE is not; set both"):
        DistributedSampler(ds)
    # explicit arguments win, as in torch
    s = DistributedSampler(ds, num_replicas=2, rank=0)
    assert (s.rank, s.num_replicas) == (0, 2)
    assert per_rank_batch(8, 2) == 4
    monkeypatch.setenv("WORLD_SIZE", "4")
    s = DistributedSampler(ds)
    assert (s.rank, s.num_replicas) == (1, 4)
    assert list(s) == list(TorchSampler(ds, 4, 1, seed=0))
    with pytest.raises(ValueError, match="rank 5 is outside world size 4"):
        DistributedSampler(ds, rank=5)
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    s = DistributedSampler(ds)
    assert (s.rank, s.num_replicas) == (0, 1)
