"""Checkpoint manifests and their verification, on real single-process saves (no process
group): what the marker records, what `verify` / `scan` / `newest_valid` find after a file
is truncated, deleted or overwritten, `load`'s `DamagedCheckpointError`, the restore choice,
and ``gangrun checkpoints URL``."""

from __future__ import annotations

import json
import os
import pickle
import time
import zlib

import pytest

torch = pytest.importorskip("torch")

from gangrun import checkpoint  # noqa: E402
from gangrun.checkpoint import DamagedCheckpointError, integrity  # noqa: E402
from gangrun.cli.entry import main as cli  # noqa: E402


def _state(v: float = 1.0) -> dict:
    return {"w": torch.full((1000,), v), "b": torch.arange(10.0) * v, "n": int(v)}


def _blank() -> dict:
    return {"w": torch.zeros(1000), "b": torch.zeros(10), "n": 0}


def _data(url: str) -> str:
    """The data file of a single-process save."""
    (name,) = [f for f in os.listdir(url) if f.endswith(".distcp")]
    return os.path.join(url, name)


def _truncate(path: str) -> int:
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    return size


@pytest.fixture
def two(tmp_path):
    """A location with two complete checkpoints, step-1 (older) and step-2."""
    root = str(tmp_path / "ckpt")
    for step in (1, 2):
        checkpoint.save(_state(step), f"{root}/step-{step}")
    return root


def test_the_marker_records_every_file_with_its_size_and_crc32(two):
    url = f"{two}/step-2"
    with open(os.path.join(url, checkpoint.MARKER)) as f:
        files = json.load(f)["files"]
    on_disk = sorted(os.listdir(url))
    assert sorted(files) == [f for f in on_disk if f != checkpoint.MARKER]
    assert ".metadata" in files and any(f.endswith(".distcp") for f in files)
    for rel, rec in files.items():
        with open(os.path.join(url, rel), "rb") as f:
            raw = f.read()
        assert rec == {"size": len(raw), "crc32": f"{zlib.crc32(raw):08x}"}, rel
    rep = checkpoint.verify(url, checksums=True)
    assert rep.ok and rep.verified and rep.checksums and rep.problems == []
    assert rep.step == 2 and rep.size == sum(r["size"] for r in files.values())


def test_a_truncated_file_is_found_and_load_names_it(two):
    url = f"{two}/step-2"
    data = _data(url)
    rel = os.path.basename(data)
    size = _truncate(data)
    rep = checkpoint.verify(url)
    assert rep.state == "damaged" and not rep.ok
    (p,) = rep.problems
    assert (p.file, p.kind) == (rel, "size")
    assert f"is truncated: {size // 2} bytes, {size} recorded" in rep.reason
    with pytest.raises(DamagedCheckpointError) as info:
        checkpoint.load(_blank(), url)
    err = info.value
    assert err.url == url and err.file == rel and isinstance(err, ValueError)
    assert f"checkpoint {url} is damaged: {rel} is truncated" in str(err)
    # torch's reader failing on the file (no size check first) says the same file
    with pytest.raises(DamagedCheckpointError) as info:
        checkpoint.load(_blank(), url, verify=False)
    assert info.value.file == rel and "could not be read" in str(info.value)
    assert url in str(info.value)
    assert "CRC-32" in str(info.value)  # the recorded checksum, compared once it failed
    back = pickle.loads(pickle.dumps(info.value))  # between ranks, as DCP sends it
    assert (back.url, back.file, str(back)) == (url, rel, str(info.value))


def test_a_deleted_file_is_missing(two):
    url = f"{two}/step-2"
    data = _data(url)
    os.remove(data)
    (p,) = checkpoint.verify(url).problems
    assert p.kind == "missing" and p.file == os.path.basename(data)
    with pytest.raises(DamagedCheckpointError, match=f"{os.path.basename(data)} is missing"):
        checkpoint.load(_blank(), url)


def test_same_size_corruption_needs_checksums(two):
    url = f"{two}/step-2"
    data = _data(url)
    with open(data, "r+b") as f:
        f.seek(os.path.getsize(data) // 2)
        b = f.read(8)
        f.seek(-8, os.SEEK_CUR)
        f.write(bytes(x ^ 0xFF for x in b))
    assert checkpoint.verify(url).ok  # sizes only: a listing
    rep = checkpoint.verify(url, checksums=True)
    assert rep.state == "damaged" and [p.kind for p in rep.problems] == ["checksum"]


def test_a_file_written_into_the_checkpoint_before_the_save_is_recorded(tmp_path):
    # as a DeepSpeed engine's files are, under <checkpoint>/deepspeed/, before the DCP save
    url = str(tmp_path / "step-1")
    os.makedirs(f"{url}/deepspeed/engine")
    with open(f"{url}/deepspeed/engine/states.pt", "wb") as f:
        f.write(b"x" * 1234)
    checkpoint.save(_state(), url)
    rep = checkpoint.verify(url)
    assert rep.ok and rep.files == 3
    with open(os.path.join(url, checkpoint.MARKER)) as f:
        assert json.load(f)["files"]["deepspeed/engine/states.pt"] == {"size": 1234}
    os.remove(f"{url}/deepspeed/engine/states.pt")
    assert [p.file for p in checkpoint.verify(url).problems] == ["deepspeed/engine/states.pt"]


def test_an_old_marker_without_manifest_is_complete_but_unverifiable(two):
    url = f"{two}/step-2"
    with open(os.path.join(url, checkpoint.MARKER), "w") as f:
        json.dump({"time": time.time(), "ranks": 1}, f)  # as gangrun wrote before manifests
    _truncate(_data(url))
    rep = checkpoint.verify(url)
    assert rep.ok and not rep.verified
    assert checkpoint.newest_valid(two) == (url, [])


def _listing(root, capsys) -> dict[str, str]:
    """``gangrun checkpoints ROOT``'s rows, by checkpoint name."""
    assert cli(["checkpoints", root]) == 0
    return {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:-1]}


def test_an_empty_marker_is_damaged_in_the_listing_and_skipped_with_a_warning(two, capsys):
    # gangrun never writes an empty marker: its write did not finish. The listing and the
    # restore both call the checkpoint damaged; the restore names it as it skips it.
    url = f"{two}/step-2"
    open(os.path.join(url, checkpoint.MARKER), "w").close()
    assert checkpoint.list_checkpoints(two) == [f"{two}/step-1", url]  # still the newest
    rep = checkpoint.verify(url)
    assert rep.state == "damaged" and [(p.file, p.kind) for p in rep.problems] == [
        (checkpoint.MARKER, "marker")
    ]
    assert (
        "damaged: _COMPLETE is empty: its write did not finish" in _listing(two, capsys)["step-2"]
    )
    with pytest.warns(integrity.DamagedCheckpointWarning, match="step-2 is damaged .*is empty"):
        choice = integrity.choose(two)
    assert integrity.chosen(choice) == f"{two}/step-1"
    assert f"checkpoint {url} is damaged (_COMPLETE is empty" in capsys.readouterr().err
    with pytest.raises(DamagedCheckpointError, match="_COMPLETE is empty"):
        checkpoint.load(_blank(), url)


def test_a_manifest_size_that_is_not_a_number_is_damaged_for_listing_and_restore(two, capsys):
    # a manifest that does not give sizes makes the checkpoint damaged, in the listing and
    # the restore alike (never a ValueError out of the scan)
    url = f"{two}/step-2"
    path = os.path.join(url, checkpoint.MARKER)
    with open(path) as f:
        marker = json.load(f)
    rel = os.path.basename(_data(url))
    marker["files"][rel]["size"] = "many"
    with open(path, "w") as f:
        json.dump(marker, f)
    reps = {r.name: r for r in checkpoint.scan(two)}
    assert reps["step-1"].ok and reps["step-2"].state == "damaged"
    why = f"_COMPLETE records a size that is not a number for {rel}: 'many'"
    assert reps["step-2"].reason == why
    assert f"damaged: {why}" in _listing(two, capsys)["step-2"]
    with pytest.warns(integrity.DamagedCheckpointWarning, match="step-2 is damaged"):
        assert integrity.chosen(integrity.choose(two)) == f"{two}/step-1"
    assert f"checkpoint {url} is damaged ({why}): skipped" in capsys.readouterr().err


def test_newest_valid_skips_damaged_ones(two):
    assert checkpoint.newest_valid(two) == (f"{two}/step-2", [])
    _truncate(_data(f"{two}/step-2"))
    found, skipped = checkpoint.newest_valid(two)
    assert found == f"{two}/step-1" and [r.name for r in skipped] == ["step-2"]
    state = _blank()
    checkpoint.load(state, found)
    assert state["n"] == 1 and torch.equal(state["w"], torch.full((1000,), 1.0))
    os.remove(_data(f"{two}/step-1"))
    found, skipped = checkpoint.newest_valid(two)
    assert found is None and [r.name for r in skipped] == ["step-2", "step-1"]


def test_the_restore_choice_warns_and_fails_naming_location_checkpoint_and_file(two, capsys):
    _truncate(_data(f"{two}/step-2"))
    with pytest.warns(integrity.DamagedCheckpointWarning, match="step-2 is damaged"):
        choice = integrity.choose(two)
    assert integrity.chosen(choice) == f"{two}/step-1"
    err = capsys.readouterr().err
    assert f"checkpoint {two}/step-2 is damaged" in err and f"restoring {two}/step-1" in err
    rel = os.path.basename(_data(f"{two}/step-1"))
    os.remove(_data(f"{two}/step-1"))
    choice = pickle.loads(pickle.dumps(integrity.choose(two)))  # broadcast to every rank
    with pytest.raises(RuntimeError) as info:
        integrity.chosen(choice)
    msg = str(info.value)
    assert f"no valid checkpoint in {two}" in msg and f"the newest, {two}/step-2" in msg
    assert "is truncated" in msg and "the 1 older one is damaged too" in msg
    checkpoint.remove(f"{two}/step-2")
    with pytest.raises(RuntimeError, match=f"the newest, {two}/step-1, is damaged .{rel} is"):
        integrity.chosen(integrity.choose(two))
    assert integrity.chosen(integrity.choose(str(two) + "-none")) is None  # nothing: step 0


def test_scan_lists_complete_damaged_and_partial(two):
    os.makedirs(f"{two}/step-3")
    with open(f"{two}/step-3/__0_0.distcp", "wb") as f:  # a save that never committed
        f.write(b"z" * 10)
    os.makedirs(f"{two}/notes")  # not a checkpoint
    _truncate(_data(f"{two}/step-2"))
    reps = checkpoint.scan(two)
    assert [(r.name, r.step, r.state) for r in reps] == [
        ("step-1", 1, "complete"),
        ("step-2", 2, "damaged"),
        ("step-3", 3, "partial"),
    ]
    assert reps[2].size == 10 and "no _COMPLETE marker" in reps[2].reason
    assert checkpoint.list_checkpoints(two) == [f"{two}/step-1", f"{two}/step-2"]


def test_cli_checkpoints_table_and_json(two, capsys):
    os.makedirs(f"{two}/step-3")
    with open(f"{two}/step-3/.metadata", "wb") as f:
        f.write(b"m")
    rel = os.path.basename(_data(f"{two}/step-2"))
    size = _truncate(_data(f"{two}/step-2"))
    assert cli(["checkpoints", two]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["CHECKPOINT", "STEP", "STATE", "SIZE", "TIME"]
    assert lines[-1] == "writer: none (no live call holds this location)"
    rows = {line.split()[0]: line for line in lines[1:-1]}
    assert list(rows) == ["step-1", "step-2", "step-3"]
    assert rows["step-1"].split()[1:3] == ["1", "complete"]
    assert f"damaged: {rel} is truncated: {size // 2} bytes, {size} recorded" in rows["step-2"]
    assert "partial: no marker" in rows["step-3"] and "1 B" in rows["step-3"]
    assert "KiB" in rows["step-1"]
    assert cli(["checkpoints", two, "--json", "--checksums"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert [(r["name"], r["state"], r["step"]) for r in got] == [
        ("step-1", "complete", 1),
        ("step-2", "damaged", 2),
        ("step-3", "partial", 3),
    ]
    assert got[1]["problems"] == [
        {"file": rel, "kind": "size", "detail": f"is truncated: {size // 2} bytes, {size} recorded"}
    ]
    assert got[0]["checksums"] is True and got[0]["size"] > 4000
    from gangrun.checkpoint import writer

    lock = writer.acquire(two, "call-1", "train", None)  # this process holds the location
    assert cli(["checkpoints", two]) == 0
    assert "writer: train (pid" in capsys.readouterr().out.splitlines()[-1]
    lock.release()
    assert cli(["checkpoints", two + "/absent"]) == 1
    assert "is not a directory" in capsys.readouterr().err
