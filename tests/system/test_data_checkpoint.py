"""VolumeDataset and VolumeWriter/Reader across real ranks, on local disk and loopback S3.

The S3-compatible server is moto in server mode on 127.0.0.1 (a real HTTP server in this
test process); ranks reach it through s3fs like any object store.
"""

from __future__ import annotations

import collections
import os

import datafns
import pytest

import gangrun
from gangrun import checkpoint
from s3server import moto_s3

N_FILES = 7  # odd: 2 ranks cannot split it evenly


@pytest.fixture(scope="module")
def s3():
    """(endpoint_url, storage_options) of a moto S3 server with bucket ``gangrun-test`` holding 7 files."""
    import s3fs

    with moto_s3("gangrun-test") as (endpoint, opts):
        fs = s3fs.S3FileSystem(**opts)
        for i in range(N_FILES):
            fs.pipe_file(f"gangrun-test/data/f{i:02d}", f"f{i:02d}".encode())
        yield endpoint, opts


def _gang(fn):
    return gangrun.distributed(processes=2, timeout=120)(fn)


@pytest.mark.slow
@pytest.mark.parametrize("num_workers", [0, 2])
def test_s3_two_ranks_read_every_file_once(s3, tmp_path, num_workers):
    _, opts = s3
    out = _gang(datafns.read_epoch).distributed(
        "s3://gangrun-test/data/", opts, str(tmp_path / "cache"), num_workers, 1
    )
    per_rank = [r["samples"] for r in sorted(out, key=lambda r: r["rank"])]
    assert len(per_rank[0]) == len(per_rank[1]) == 4  # ceil(7 / 2), padded
    counts = collections.Counter(per_rank[0] + per_rank[1])
    assert set(counts) == {f"f{i:02d}".encode() for i in range(N_FILES)}
    assert sum(counts.values()) == 8 and max(counts.values()) == 2  # one file padded
    # Both ranks filled one shared cache (the padded file was wanted twice, fetched once).
    entries = [f for _, _, fs in os.walk(tmp_path / "cache" / "data") for f in fs]
    assert len(entries) == N_FILES


def _assert_restored(out, step):
    for rank, r in enumerate(out):
        assert r["own"] == [float(step * 10 + rank)] * 3
        assert r["shared"] == [float(step * i) for i in range(4)]
        assert r["step"] == step


@pytest.mark.slow
@pytest.mark.parametrize("where", ["local", "s3"])
def test_checkpoint_two_ranks_and_crash_midway(s3, tmp_path, where):
    if where == "s3":
        _, opts = s3
        root = f"s3://gangrun-test/ckpt-{tmp_path.name}"
    else:
        opts, root = {}, str(tmp_path / "ckpt")
    save = _gang(datafns.save_checkpoint)
    save.distributed(f"{root}/step-1", 1, opts)
    assert checkpoint.latest(root, **opts).endswith("step-1")
    save.distributed(f"{root}/step-2", 2, opts)
    assert checkpoint.latest(root, **opts).endswith("step-2")

    # Rank 1 dies in the middle of writing step-3: step-2 stays the latest.
    # (Which rank is blamed is the launcher's business: rank 0's gloo error can win the race.)
    with pytest.raises(gangrun.DistributedError):
        save.distributed(f"{root}/step-3", 3, opts, 1)
    assert checkpoint.latest(root, **opts).endswith("step-2")
    assert not checkpoint.is_complete(f"{root}/step-3", **opts)
    import torch

    with pytest.raises(checkpoint.IncompleteCheckpointError):
        checkpoint.load({"shared": torch.zeros(4)}, f"{root}/step-3", storage_options=opts)
    _assert_restored(_gang(datafns.load_checkpoint).distributed(root, opts), 2)

    # Overwriting a complete checkpoint and crashing un-commits it.
    with pytest.raises(gangrun.DistributedError):
        save.distributed(f"{root}/step-2", 4, opts, 1)
    assert checkpoint.latest(root, **opts).endswith("step-1")


@pytest.mark.slow
@pytest.mark.parametrize("num_workers", [0, 2])
def test_dataset_resumes_mid_epoch_after_restart(tmp_path, num_workers):
    src = tmp_path / "data"
    src.mkdir()
    for i in range(11):
        (src / f"s{i:02d}").write_text(f"s{i:02d}")
    root = str(tmp_path / "ckpt")
    train = _gang(datafns.train_part)
    first = train.distributed(str(src), root, 2, num_workers)  # 2 batches of 2, checkpoint
    second = train.distributed(str(src), root, 100, num_workers)  # resume: rest of the epoch
    full = _gang(datafns.read_epoch).distributed(str(src), {}, str(tmp_path / "c"), 0, 0, 11)
    for rank in range(2):
        assert first[rank]["step"] == 2 and len(first[rank]["seen"]) == 4
        got = first[rank]["seen"] + second[rank]["seen"]
        assert len(got) == 6
        # Same samples (and order within each worker's stream) as one uninterrupted epoch.
        expected = sorted(datafns_full(full, rank))
        assert sorted(got) == expected


def datafns_full(full, rank):
    r = next(r for r in full if r["rank"] == rank)
    return [b.decode() for b in r["samples"]]


@pytest.mark.slow
def test_stream_train_example_resumes_mid_epoch_to_the_same_model(tmp_path):
    """``examples/stream_train.py``: one loader (its worker kept across epochs) over 2 epochs
    straight, against 1 epoch and then a second call that resumes from the newest
    checkpoint, mid-epoch: the same steps and the same final loss (every sample in the same
    order, the model and optimizer restored)."""
    import sys

    from conftest import ROOT

    examples = str(ROOT / "examples")
    if examples not in sys.path:
        sys.path.insert(0, examples)  # the ranks get this sys.path and import it too
    import stream_train

    data = str(tmp_path / "data")
    stream_train.make_dataset(data)
    train = _gang(stream_train.train)
    full = train.distributed(data, str(tmp_path / "a"), 2, 5, 8)
    first = train.distributed(data, str(tmp_path / "b"), 1, 5, 8)
    assert first[0]["step"] % 5 != 0  # the last checkpoint of epoch 0 is before its end
    rest = train.distributed(data, str(tmp_path / "b"), 2, 5, 8)
    assert [r["step"] for r in rest] == [r["step"] for r in full]
    assert rest[0]["loss"] == pytest.approx(full[0]["loss"], rel=1e-6)
    assert rest[0]["loss"] != pytest.approx(first[0]["loss"], rel=1e-3)
