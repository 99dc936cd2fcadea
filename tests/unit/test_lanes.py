"""The global batch held (`gangrun.data.lanes`): the lane arithmetic alone, no process.

Every rank of every world size that divides the lanes, with any number of DataLoader workers
(each worker's part of each batch joined in worker order, as the loader joins them), reads the
same global batch ``k``: the same set of positions. An epoch reads every position once
(``drop`` with whole global batches; ``pad`` repeats fewer than a global batch, from the
order's beginning). The micro-batch helper splits a rank's batch for gradient accumulation.
"""

from __future__ import annotations

import collections

import pytest

from gangrun.data import lanes

torch = pytest.importorskip("torch")


def _global_batches(n, g, k, world, nw, uneven="drop"):
    """Global batch ``b`` as the ranks of ``world`` (``nw`` workers each; 0: in the rank's
    process) read it: each rank's batch is its workers' parts in worker order."""
    lay = lanes.layout(n, g, k, uneven)
    out = []
    for b in range(lay.batches):
        whole = []
        for r in range(world):
            mine = lanes.rank_lanes(k, r, world)
            rank_batch = []
            for w in range(max(1, nw)):
                rank_batch += lanes.batch_part(lay, lanes.worker_lanes(mine, w, max(1, nw)), b)
            assert rank_batch == lanes.batch_part(lay, mine, b)  # lane order, whatever nw
            assert len(rank_batch) == g // world
            whole += rank_batch
        out.append(sorted(whole))
    return out


@pytest.mark.parametrize("uneven", ["drop", "pad"])
def test_the_same_global_batches_on_every_world_and_worker_count(uneven):
    n, g, k = 150, 12, 6  # 12 global batches (drop) or 13 (pad)
    ref = _global_batches(n, g, k, 1, 0, uneven)
    for world in (1, 2, 3, 6):
        for nw in (0, 1, 2, 3):
            assert _global_batches(n, g, k, world, nw, uneven) == ref, (world, nw)
    read = collections.Counter(p for batch in ref for p in batch)
    if uneven == "drop":
        assert len(ref) == n // g and max(read.values()) == 1 and n - len(read) < g
    else:
        assert set(read) == set(range(n)) and sum(read.values()) - n < g
    assert all(len(batch) == g for batch in ref)


def test_a_worker_reads_whole_lanes():
    # a lane (its files or row groups) is read by one worker: the workers' lanes partition
    # the rank's, contiguously; a worker beyond the lanes has none
    mine = lanes.rank_lanes(12, 1, 4)
    assert mine == range(3, 6)
    parts = [lanes.worker_lanes(mine, w, 2) for w in range(2)]
    assert parts == [range(3, 4), range(4, 6)]
    many = [lanes.worker_lanes(mine, w, 5) for w in range(5)]
    assert sorted(x for p in many for x in p) == [3, 4, 5] and sum(not p for p in many) == 2
    lay = lanes.layout(120, 12, 12, "drop")  # each lane: 10 contiguous positions
    assert lanes.run(lay, range(3, 4)) == list(range(30, 40))
    assert lanes.run(lay, range(3, 4), first=7) == [37, 38, 39]


def test_a_world_that_does_not_divide_the_lanes_is_refused():
    lanes.check(12, 6, 3, "TableDataset")
    with pytest.raises(
        ValueError, match=r"world size 4 does not divide lanes=6.* 1, 2, 3, 6 ranks"
    ):
        lanes.check(12, 6, 4, "TableDataset", rank=2)
    with pytest.raises(ValueError, match="global_batch_size=10 does not split into lanes=4"):
        lanes.check(10, 4, 1, "VolumeDataset")
    assert lanes.default_lanes(4096, per_item=False) == 8
    assert lanes.default_lanes(96, per_item=True) == 96


def test_micro_batches_split_a_batch_for_gradient_accumulation():
    from gangrun.data import micro_batches

    x = torch.arange(10.0).reshape(5, 2)
    batch = {"x": x, "ids": [10, 11, 12, 13, 14]}
    parts = list(micro_batches(batch, 2))
    assert [p["ids"] for p, _ in parts] == [[10, 11], [12, 13], [14]]
    assert torch.equal(torch.cat([p["x"] for p, _ in parts]), x)
    assert [w for _, w in parts] == [0.4, 0.4, 0.2]
    # accumulated, the weighted micro-batch gradients are the whole batch's mean gradient
    w = torch.ones(2, requires_grad=True)
    (x @ w).pow(2).mean().backward()
    whole = w.grad.clone()
    w.grad = None
    for part, weight in micro_batches((x,), 2):
        ((part[0] @ w).pow(2).mean() * weight).backward()
    assert torch.allclose(w.grad, whole)
    with pytest.raises(ValueError, match="hold \\[2, 3\\] samples"):
        list(micro_batches({"a": torch.zeros(3), "b": torch.zeros(2)}, 1))
