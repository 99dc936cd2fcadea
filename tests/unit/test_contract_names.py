"""Every ``GANGRUN_*`` name is a constant of `gangrun.wire.contract`.

Each module of ``src/`` is read with ``ast``: a string constant (an f-string's literal parts
included) that contains ``GANGRUN_`` outside ``contract.py`` fails, naming the file and line.
Docstrings are documentation and may name the variables. And every constant of the contract
is documented in its module docstring.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
CONTRACT = SRC / "gangrun" / "wire" / "contract.py"


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring nodes of a module, its classes and functions."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def literals(source: str, name: str = "<src>") -> list[tuple[int, str]]:
    """(line, text) of every non-docstring string constant containing ``GANGRUN_``."""
    tree = ast.parse(source, name)
    skip = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and "GANGRUN_" in node.value
            and id(node) not in skip
        ):
            found.append((node.lineno, node.value))
    return found


def test_the_scanner_sees_plain_strings_and_f_strings_but_not_docstrings():
    src = '''
"""Module doc: GANGRUN_X is fine here."""
A = "GANGRUN_A"
def f(x):
    """GANGRUN_DOC"""
    return f"set GANGRUN_B={x}"
class C:
    """GANGRUN_CLASS_DOC"""
    y = {"k": "no"}
'''
    got = sorted(text for _, text in literals(src))
    assert got == ["GANGRUN_A", "set GANGRUN_B="]


def test_no_gangrun_literal_outside_the_contract():
    bad = []
    for path in sorted(SRC.rglob("*.py")):
        if path == CONTRACT:
            continue
        for line, text in literals(path.read_text(), str(path)):
            bad.append(f"{path.relative_to(SRC)}:{line}: {text[:60]!r}")
    assert not bad, (
        "GANGRUN_* names belong in gangrun/wire/contract.py (a constant, documented there); "
        "use the constant instead of:\n" + "\n".join(bad)
    )


def test_every_contract_constant_is_documented():
    import gangrun.wire.contract as c

    doc = c.__doc__ or ""
    names = [v for k, v in vars(c).items() if k.isupper() and isinstance(v, str)]
    assert names, "the contract declares its names as upper-case str constants"
    missing = [
        v for v in names if v.startswith(c.PREFIX) and v != c.PREFIX and f"``{v}``" not in doc
    ]
    assert not missing, f"not documented in gangrun.wire.contract's docstring: {missing}"
