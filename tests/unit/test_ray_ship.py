"""What a Ray call ships and how nodes map paths, version checks, remote error notes (no
cluster: the cluster tests are tests/system/test_ray_cluster.py)."""

from __future__ import annotations

import os
import sys
import warnings

import pytest

from gangrun import LaunchError
from gangrun.launch.ray import diagnose, ship, versions
from gangrun.launch.ray.records import ActorContext, FilesIdentity, NodeInfo, ShipMap
from gangrun.wire.records import ErrorRecord


def _tree(root, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def test_gitignore_and_always_excluded_are_left_out(tmp_path):
    _tree(
        tmp_path,
        {
            ".gitignore": "*.ckpt\nbig/\n",
            "a.py": "x",
            "m.ckpt": "x",
            "big/w.bin": "x",
            "sub/.gitignore": "local.txt\n",
            "sub/local.txt": "x",
            "sub/b.py": "x",
            "__pycache__/a.cpython-311.pyc": "x",
            "env/pyvenv.cfg": "x",
            "env/lib/x.py": "x",
            "data/keep.txt": "x",
        },
    )
    names = [rel for rel, _ in ship.list_files(str(tmp_path), excludes=["data/"])]
    assert names == [".gitignore", "a.py", "sub/.gitignore", "sub/b.py"]


def test_content_hash_changes_with_content_not_with_touch(tmp_path):
    _tree(tmp_path, {"a.py": "x = 1\n"})
    _, h1 = ship.scan_root(str(tmp_path), ())
    os.utime(tmp_path / "a.py", ns=(1, 1))  # same content, new stat: re-hashed, same hash
    _, h2 = ship.scan_root(str(tmp_path), ())
    (tmp_path / "a.py").write_text("x = 2\n")
    _, h3 = ship.scan_root(str(tmp_path), ())
    assert h1 == h2 != h3


def test_size_cap_names_the_biggest_entries(tmp_path):
    _tree(tmp_path, {"small.py": "x", "data/a.bin": "y" * 5000, "w.bin": "z" * 3000})
    with pytest.raises(LaunchError) as info:
        ship.build(str(tmp_path), [], (), max_bytes=1000)
    text = str(info.value)
    assert text.index("data/") < text.index("w.bin")  # biggest first
    assert "RayOptions(excludes=" in text and "max_ship_bytes" in text and "ship=False" in text


def test_module_roots_are_local_paths_of_the_modules_only(tmp_path, monkeypatch):
    _tree(tmp_path, {"lib/mymod_ship_test.py": "X = 1\n", "proj/a.py": ""})
    monkeypatch.syspath_prepend(str(tmp_path / "lib"))
    import mymod_ship_test  # noqa: F401

    roots = ship.module_roots(
        ["mymod_ship_test", "json", "pytest", "gangrun"], sys.path, str(tmp_path / "proj")
    )
    assert roots == [str(tmp_path / "lib")]  # not the stdlib, site-packages or gangrun


def test_remote_paths_map_the_caller_paths_into_the_copies():
    ctx = ShipMap(
        "/home/me/proj", (("/home/me/proj", "_ray_pkg_grA"), ("/opt/lib", "_ray_pkg_grB"))
    )
    node = ["/x/_ray_pkg_grA", "/y/_ray_pkg_grB", "/usr/lib/python3.11"]
    cwd, paths = ship.remote_paths(ctx, ["", "/home/me/proj/src", "/opt/lib", "/elsewhere"], node)
    assert cwd == "/x/_ray_pkg_grA"
    assert paths == [
        "",
        "/x/_ray_pkg_grA/src",
        "/y/_ray_pkg_grB",
        "/elsewhere",
        "/usr/lib/python3.11",
    ]
    assert ship.caller_paths_only(ctx, node) == ["/usr/lib/python3.11"]


def test_versions_major_is_an_error_patch_a_warning():
    mine = {"python": "3.11.7", "gangrun": "0.4.0", "torch": "2.13.0+cpu"}
    node = {"node_id": "a" * 32, "ip": "10.0.0.7"}
    patch = {0: NodeInfo(**node, versions={**mine, "torch": "2.13.1+cu124"})}
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        versions.check(patch, mine)
    assert "torch 2.13.1+cu124 on node 10.0.0.7" in str(w[0].message)
    major = {0: NodeInfo(**node, versions={**mine, "python": "3.10.2", "torch": None})}
    with pytest.raises(LaunchError) as info:
        versions.check(major, mine)
    text = str(info.value)
    assert "python 3.10.2 on node 10.0.0.7 (Ray node id aaaaaaaaaaaaaaaa) vs 3.11.7 here" in text
    assert "torch not installed on node 10.0.0.7" in text and "not started" in text


def test_missing_file_on_a_node_names_it_and_the_fix(tmp_path):
    _tree(tmp_path, {"proj/.gitignore": "secret.txt\n", "proj/secret.txt": "s", "out/x.txt": "x"})
    manifest, _ = ship.build(str(tmp_path / "proj"), [], (), None)
    info = NodeInfo(ip="10.0.0.7", node_id="b" * 32)

    def rec(path: str) -> ErrorRecord:
        msg = f"[Errno 2] No such file or directory: '{path}'"
        return ErrorRecord(1, "FileNotFoundError", msg, "Traceback ...\n", 0.0)

    far = diagnose.explain(
        rec(str(tmp_path / "out/x.txt")), info, manifest, True, str(tmp_path / "proj"), "/r"
    )
    assert (
        "exists on this machine but not on node 10.0.0.7 (Ray node id bbbbbbbbbbbbbbbb)"
        in far.message
    )
    assert "RayOptions(paths=" in far.message and far.traceback.endswith(".\n")
    hidden = diagnose.explain(
        rec("/r/secret.txt"), info, manifest, True, str(tmp_path / "proj"), "/r"
    )
    assert (
        f"{tmp_path / 'proj' / 'secret.txt'} exists" in hidden.message
        and "excluded" in hidden.message
    )
    off = diagnose.explain(rec("secret.txt"), info, None, False, str(tmp_path / "proj"), "/r")
    assert "shipping is off" in off.message
    other = diagnose.explain(
        ErrorRecord(1, "ValueError", "bad", "tb", 0.0), info, manifest, True, "/", "/r"
    )
    assert other.message.startswith("bad\n(rank 1 ran on node 10.0.0.7")


def test_the_actor_context_is_records_all_the_way(tmp_path):
    import dataclasses

    from gangrun.wire.records import RankContext

    fields = {f.name: f.type for f in dataclasses.fields(ActorContext)}
    assert not [n for n, t in fields.items() if "dict" in str(t)], fields
    mine = ship.files_identity(str(tmp_path))
    assert isinstance(mine, FilesIdentity) and mine.ino == os.stat(tmp_path).st_ino
    assert ship.sees_caller_files(mine, str(tmp_path))
    assert not ship.sees_caller_files(mine, str(tmp_path.parent))
    gone = ship.files_identity(str(tmp_path / "absent"))
    assert gone.ino == -1 and not ship.sees_caller_files(gone, str(tmp_path / "absent"))
    ctx = ActorContext(rank=RankContext(sys_path=[], cwd=str(tmp_path)))
    assert ctx.ship == ShipMap() and ctx.caller_files is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.ship.cwd = "/elsewhere"  # type: ignore[misc]
    manifest, _ = ship.build(str(tmp_path), [], (), None)
    assert manifest.context() == ShipMap(str(tmp_path), ((str(tmp_path), manifest.roots[0].name),))
