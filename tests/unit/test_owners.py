"""One owner per job, checked on the source: each job below is done in one module, and the
others reach it there (a copy would drift from it)."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

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
    assert defined["PEER_ECHO_TEXT"] == ["errors.py"]
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
