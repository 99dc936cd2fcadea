"""Damaged checkpoints in real 2-rank calls with a Checkpointer (docs/long_runs.md, "Damaged
checkpoints"): a data file of the newest checkpoint truncated after its commit (its marker
kept) is skipped for the previous checkpoint, with a warning naming it, and the run still ends
bitwise where an uninterrupted run ends; when every checkpoint is damaged (a file truncated
or deleted) the call fails naming the location, the checkpoint and the file, before any step;
a resumed MLflow run is refused before any rank starts; DeepSpeed's own files are in the
manifest.

The training is tests/system/ckptfns.py's (DDP on gloo, a shuffled VolumeLoader, Adam, an
LR scheduler, noise from every RNG; ``keep=2``).
"""

from __future__ import annotations

import json
import os

import ckptfns
import pytest

import gangrun
from gangrun import checkpoint

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.slow

TOTAL, EVERY = 8, 3


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("damaged-data"))
    ckptfns.write_data(root)
    return root


def _train(**opts):
    opts = {"processes": 2, "timeout": 240, "output": "rank0", **opts}
    return gangrun.distributed(**opts)(ckptfns.train)


@pytest.fixture(scope="module")
def base(data, tmp_path_factory):
    """The uninterrupted run of TOTAL steps."""
    where = str(tmp_path_factory.mktemp("damaged-base"))
    return _train(checkpoint_dir=where).distributed("ddp", data, TOTAL, EVERY)[0]


def _two_checkpoints(data, root):
    """A run stopped after 7 steps: checkpoints step 6 and step 7 (keep=2)."""
    _train(checkpoint_dir=root).distributed("ddp", data, 7, EVERY)
    kept = checkpoint.list_checkpoints(root)
    assert [k.rsplit("-", 1)[1] for k in kept] == ["000000006", "000000007"]
    return kept


def _truncate(path):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)


def test_a_damaged_newest_checkpoint_is_skipped_and_the_run_ends_as_uninterrupted(
    base, data, tmp_path, capfd
):
    root = str(tmp_path / "ckpt")
    older, newest = _two_checkpoints(data, root)
    _truncate(os.path.join(newest, "__1_0.distcp"))  # rank 1's data file; the marker stays
    assert checkpoint.is_complete(newest) and checkpoint.latest(root) == newest
    capfd.readouterr()
    out = _train(checkpoint_dir=root).distributed("ddp", data, TOTAL, EVERY)
    said = "".join(capfd.readouterr())
    assert f"checkpoint {newest} is damaged (__1_0.distcp is truncated" in said, said
    assert f"restoring {older} instead" in said
    got = out[0]
    assert got["restored_from"] == older and got["start"] == 6
    assert got["params"].keys() == base["params"].keys()
    for k, v in base["params"].items():
        assert torch.equal(got["params"][k], v), f"parameter {k} differs after the fallback"
    assert got["losses"] == {s: base["losses"][s] for s in (6, 7)}


def test_every_checkpoint_damaged_fails_naming_location_checkpoint_and_file(data, tmp_path):
    root = str(tmp_path / "ckpt")
    older, newest = _two_checkpoints(data, root)
    _truncate(os.path.join(newest, "__0_0.distcp"))
    os.remove(os.path.join(older, "__0_0.distcp"))
    with pytest.raises(gangrun.DistributedError) as info:
        _train(checkpoint_dir=root).distributed("ddp", data, TOTAL, EVERY)
    msg = str(info.value)
    assert f"no valid checkpoint in {root}: the newest, {newest}, is damaged" in msg, msg
    assert "__0_0.distcp is truncated" in msg and "the 1 older one is damaged too" in msg
    assert "RuntimeError" in msg and "PytorchStreamReader" not in msg
    # a deleted file says the same: the newest left is the one with the deleted file
    checkpoint.remove(newest)
    with pytest.raises(gangrun.DistributedError) as info:
        _train(checkpoint_dir=root).distributed("ddp", data, TOTAL, EVERY)
    msg = str(info.value)
    assert f"no valid checkpoint in {root}: the newest, {older}, is damaged" in msg, msg
    assert "__0_0.distcp is missing" in msg


@pytest.mark.mlflow
def test_a_resumed_run_whose_checkpoints_are_all_damaged_is_refused_before_any_rank(data, tmp_path):
    root = str(tmp_path / "ckpt")
    handle = _train(checkpoint_dir=root).submit("ddp", data, 4, 2)
    handle.result()
    kept = checkpoint.list_checkpoints(root)
    assert len(kept) == 2
    for k in kept:
        _truncate(os.path.join(k, "__0_0.distcp"))
    with pytest.raises(gangrun.LaunchError) as info:
        _train(run_id=handle.mlflow_run_id).distributed("ddp", data, 4, 2)
    msg = str(info.value)
    assert f"cannot resume: no valid checkpoint in {root}: the newest, {kept[-1]}" in msg, msg
    assert "__0_0.distcp is truncated" in msg


def test_deepspeed_files_are_in_the_manifest(data, tmp_path):
    root = str(tmp_path / "ckpt")
    _train(checkpoint_dir=root).distributed("deepspeed", data, EVERY, EVERY)
    (url,) = checkpoint.list_checkpoints(root)
    with open(os.path.join(url, checkpoint.MARKER)) as f:
        files = json.load(f)["files"]
    ds = [rel for rel in files if rel.startswith("deepspeed/")]
    assert ds and all(files[rel]["size"] > 0 for rel in ds), files
    assert checkpoint.verify(url).ok
    os.remove(os.path.join(url, ds[0]))
    rep = checkpoint.verify(url)
    assert [(p.file, p.kind) for p in rep.problems] == [(ds[0], "missing")]
