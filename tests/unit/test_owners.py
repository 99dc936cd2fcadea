"""One owner per job, checked on the source: each job below is done in one module, and the
others reach it there (a copy would drift from it)."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

import gangrun

SRC = Path(gangrun.__file__).resolve().parent


@functools.cache
def _modules() -> dict[str, ast.Module]:
    return {
        str(p.relative_to(SRC)): ast.parse(p.read_text(), str(p)) for p in sorted(SRC.rglob("*.py"))
    }


def _named(node: ast.AST) -> str:
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    return ""


def test_a_verdict_is_compared_as_a_decision_never_as_a_string():
    found = []
    for name, tree in _modules().items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            words = [s.value for s in sides if isinstance(s, ast.Constant)]
            named = [_named(s).lower() for s in sides]
            if {"stop", "restart"} & set(words) and any(
                "decision" in n or "verdict" in n for n in named
            ):
                found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    assert found == []


def test_the_failure_patterns_have_one_home_the_policy_reads_them_there():
    trees = _modules()
    defined: dict[str, list[str]] = {}
    for name, tree in trees.items():
        for node in tree.body:
            targets = node.targets if isinstance(node, ast.Assign) else []
            for t in targets:
                if isinstance(t, ast.Name) and t.id.endswith(("_TEXT", "_TYPES")):
                    defined.setdefault(t.id, []).append(name)
    assert defined["TRANSIENT_TEXT"] == ["lifecycle/rootcause.py"]
    assert defined["TRANSIENT_TYPES"] == ["lifecycle/rootcause.py"]
    assert defined["UNAVAILABLE_TEXT"] == ["lifecycle/rootcause.py"]
    assert defined["PEER_ECHO_TEXT"] == ["wire/errors.py"]
    policy = trees["lifecycle/policy.py"]
    imported = {
        a.name
        for n in ast.walk(policy)
        if isinstance(n, ast.ImportFrom) and n.module == "rootcause"
        for a in n.names
    }
    assert {"TRANSIENT_TEXT", "is_transient_exception", "unavailable_backend"} <= imported
    texts = [
        n.value
        for n in ast.walk(policy)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and "NCCL" in n.value
    ]
    assert [t for t in texts if len(t) < 40] == []  # no pattern spelled here again


def _dcp_aliases(tree: ast.Module) -> set[str]:
    """The names ``torch.distributed.checkpoint`` goes by in a module (``dcp``...)."""
    names = {"torch.distributed.checkpoint"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch.distributed.checkpoint" and a.asname:
                    names.add(a.asname)
        elif isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
            for a in node.names:
                if a.name == "checkpoint":
                    names.add(a.asname or a.name)
    return names


def test_one_function_writes_a_checkpoint():
    # gangrun.checkpoint.save and the Checkpointer both write through volume.write: a
    # second caller of DCP's save would be a second writer to keep in step (the marker, the
    # manifest, the quiet single process)
    calls = []
    for name, tree in _modules().items():
        aliases = _dcp_aliases(tree)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("save", "async_save")
                and ast.unparse(node.func.value) in aliases
            ):
                calls.append(f"{name}:{ast.unparse(node.func)}")
            if isinstance(node, ast.ImportFrom) and node.module == "torch.distributed.checkpoint":
                calls += [f"{name}:{a.name}" for a in node.names if "save" in a.name]
    assert sorted(calls) == [
        "checkpoint/volume.py:dcp.async_save",
        "checkpoint/volume.py:dcp.save",
    ]


def test_the_storage_classes_are_plain_classes_reached_lazily():
    import subprocess
    import sys

    volume = _modules()["checkpoint/volume.py"]
    classes = {n.name for n in volume.body if isinstance(n, ast.ClassDef)}
    assert {"VolumeWriter", "VolumeReader"} <= classes
    package = _modules()["checkpoint/__init__.py"]
    assert not [n for n in ast.walk(package) if isinstance(n, ast.ClassDef) and "Volume" in n.name]
    code = (
        "import sys, gangrun.checkpoint, gangrun.rank.checkpointer\n"
        "assert 'torch' not in sys.modules and 'mlflow' not in sys.modules, 'imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    pytest.importorskip("torch")
    from gangrun import checkpoint
    from gangrun.checkpoint.volume import VolumeReader, VolumeWriter

    assert (checkpoint.VolumeWriter, checkpoint.VolumeReader) == (VolumeWriter, VolumeReader)


def test_the_checkpointer_leaves_the_io_and_the_tracking_to_their_owners():
    tree = _modules()["rank/checkpointer.py"]
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported |= {f"{node.module}.{a.name}" for a in node.names}
    # the exactly-once metrics: rank/step_metrics.py; the I/O: rank/checkpoint_io.py
    assert not [m for m in imported if "mlflow" in m or "torch.distributed.checkpoint" in m]
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    assert not names & {"MlflowClient", "Metric", "DefaultStager", "dcp"}


def test_shipping_to_ray_nodes_has_one_owner_with_every_private_ray_name():
    owner = "launch/ray/ship.py"
    found = []
    for name, tree in _modules().items():
        if name == "_compat_imports.py":  # the guard itself (its docstring names them)
            continue
        doc = tree.body[0].value if tree.body and isinstance(tree.body[0], ast.Expr) else None
        for node in ast.walk(tree):
            words: list[str] = []
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node is not doc:
                words.append(node.value)
            elif isinstance(node, ast.Import):
                words += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                words.append(node.module or "")
            elif isinstance(node, ast.Attribute) and node.attr in ("_private", "_raylet"):
                words.append(ast.unparse(node))
            elif isinstance(node, ast.Call) and _named(node.func) == "_ray_private":
                words.append("ray._private")
            if any("ray._" in w or w.endswith(("._private", "._raylet")) for w in words):
                found.append(name)
    assert set(found) == {owner}, sorted(set(found))
    ship = _modules()[owner]
    doc = (ast.get_docstring(ship) or "").split("\n\n")
    assert "working_dir" in doc[1] and "stat" in doc[1]  # says first why not Ray's, measured
    globals_ = [
        t.id
        for n in ship.body
        if isinstance(n, (ast.Assign, ast.AnnAssign))
        for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
        if isinstance(t, ast.Name)
    ]
    assert "uploads" not in globals_  # what a call shipped is its `Uploaded` record
    plan = _modules()["lifecycle/ray_plan.py"]
    assert "upload_runtime_env" in {
        a.name for n in ast.walk(plan) if isinstance(n, ast.ImportFrom) for a in n.names
    }
