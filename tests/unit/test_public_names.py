"""The public surface, checked from outside: every name a public module exports resolves, and
the examples and the docs' code use public names only.

The public modules are `PUBLIC` (the package and its user-facing packages) plus what the API
reference documents (``::: gangrun.x`` in docs/reference/*.md): a directive naming a module
makes the module public, one naming an object makes that one name public at that path. Every
other module (``gangrun.host``, ``gangrun.wire``, ``gangrun.rank``...) is internal: a user's
script never imports it, so neither do the examples nor the docs' code blocks.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
PUBLIC = (
    "gangrun",
    "gangrun.errors",
    "gangrun.data",
    "gangrun.checkpoint",
    "gangrun.tracking",
    "gangrun.compat",
)
# The libraries behind gangrun's optional extras (pyproject.toml): a name that needs one may
# fail to resolve where it is not installed, with the library's ModuleNotFoundError.
OPTIONAL = {
    "torch",
    "mlflow",
    "pynvml",
    "ray",
    "deepspeed",
    "fsspec",
    "s3fs",
    "pyarrow",
    "deltalake",
    "IPython",
}
DIRECTIVE = re.compile(r"^::: (gangrun(?:\.\w+)*)\s*$", re.M)
FENCE = re.compile(r"^```(?:python|py|pycon)\n(.*?)^```", re.M | re.S)


def _module_path(mod: str) -> Path | None:
    base = SRC / Path(*mod.split("."))
    for path in (base / "__init__.py", base.with_suffix(".py")):
        if path.is_file():
            return path
    return None


def _reference() -> tuple[set[str], set[tuple[str, str]]]:
    """The modules and the (module, name) pairs the API reference documents."""
    modules: set[str] = set()
    names: set[tuple[str, str]] = set()
    for page in sorted((ROOT / "docs" / "reference").glob("*.md")):
        for target in DIRECTIVE.findall(page.read_text()):
            if _module_path(target) is not None:
                modules.add(target)
                continue
            mod, name = target.rsplit(".", 1)
            assert _module_path(mod) is not None, f"{page.name}: ::: {target}: no such module"
            names.add((mod, name))
    return modules, names


REF_MODULES, REF_NAMES = _reference()
PUBLIC_MODULES = set(PUBLIC) | REF_MODULES


def _all(mod: str) -> set[str]:
    """``mod.__all__``, read from the source (no import)."""
    path = _module_path(mod)
    assert path is not None, mod
    for node in ast.parse(path.read_text()).body:
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
            and isinstance(node.value, (ast.List, ast.Tuple))
        ):
            return {e.value for e in node.value.elts if isinstance(e, ast.Constant)}
    return set()


def is_public(mod: str, name: str | None = None) -> bool:
    """``mod`` is a public module; with ``name``: ``from mod import name`` is public (an
    exported name, a public submodule, or a name the reference documents at that path)."""
    if name is None:
        return mod in PUBLIC_MODULES
    if (mod, name) in REF_NAMES:
        return True
    return mod in PUBLIC_MODULES and (name in _all(mod) or f"{mod}.{name}" in PUBLIC_MODULES)


def _code(source: str) -> str:
    """A code block made parseable: a doctest's prompts removed, IPython's magics left out."""
    lines = []
    for line in source.splitlines():
        stripped = line.lstrip()
        if stripped.startswith((">>> ", "... ")) or stripped in (">>>", "..."):
            line = stripped[4:]
        if stripped.startswith(("%", "!")):
            continue
        lines.append(line)
    return textwrap.dedent("\n".join(lines))


def private_uses(source: str) -> list[str]:
    """The imports and ``gangrun.x`` attributes of ``source`` that are not public."""
    try:
        tree = ast.parse(_code(source))
    except SyntaxError:  # prose in a block (``...`` elisions): its import lines alone
        lines = [ln for ln in _code(source).splitlines() if re.match(r"\s*(from|import) ", ln)]
        tree = ast.parse("\n".join(ln.strip() for ln in lines))
    bad = []
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "gangrun" and not is_public(a.name):
                    bad.append(f"import {a.name}")
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            if node.module.split(".")[0] == "gangrun":
                for a in node.names:
                    if a.name == "*" and is_public(node.module):
                        continue
                    if not is_public(node.module, a.name):
                        bad.append(f"from {node.module} import {a.name}")
        elif isinstance(node, ast.Attribute) and id(node) not in inner:
            chain = []
            cur: ast.AST = node
            while isinstance(cur, ast.Attribute):
                chain.append(cur.attr)
                cur = cur.value
            if isinstance(cur, ast.Name) and cur.id == "gangrun":
                bad.extend(_private_attribute(list(reversed(chain))))
    return sorted(set(bad))


def _private_attribute(attrs: list[str]) -> list[str]:
    """``gangrun.a.b.c`` read left to right: the first name that is not public, if any (an
    attribute of a public name, ``gangrun.checkpoint.latest``'s ``.__doc__``, is not a module's)."""
    mod = "gangrun"
    for name in attrs:
        if not is_public(mod, name):
            return [f"{mod}.{name}"]
        if f"{mod}.{name}" not in PUBLIC_MODULES:
            return []
        mod = f"{mod}.{name}"
    return []


def _sources() -> dict[str, str]:
    """Each example script, notebook cell and python block of the README and the docs."""
    out = {}
    for path in sorted((ROOT / "examples").glob("*.py")):
        out[str(path.relative_to(ROOT))] = path.read_text()
    for path in sorted((ROOT / "examples").glob("*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        for i, cell in enumerate(cells):
            if cell["cell_type"] == "code":
                out[f"{path.relative_to(ROOT)} cell {i}"] = "".join(cell["source"])
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for i, block in enumerate(FENCE.findall(path.read_text())):
            out[f"{path.relative_to(ROOT)} block {i}"] = block
    return out


def test_examples_and_docs_use_public_names_only():
    sources = _sources()
    assert len([s for s in sources if s.startswith("examples/")]) >= 8
    assert len([s for s in sources if s.startswith("docs/")]) >= 20
    bad = [f"{where}: {use}" for where, code in sources.items() for use in private_uses(code)]
    assert not bad, (
        "internal names in user code (make what it needs public, exported and in the API "
        "reference):\n" + "\n".join(bad)
    )


def test_the_public_names_check_rejects_internal_modules():
    assert private_uses("from gangrun.host.accelerators import detect") == [
        "from gangrun.host.accelerators import detect"
    ]
    assert private_uses("import gangrun.wire.records") == ["import gangrun.wire.records"]
    assert private_uses(">>> import gangrun\n>>> gangrun.host.accelerators.detect()") == [
        "gangrun.host"
    ]
    assert private_uses("import gangrun\ngangrun.records.RankFailure") == ["gangrun.records"]
    ok = (
        "import gangrun\nfrom gangrun import distributed, checkpoint, errors\n"
        "from gangrun.data import VolumeDataset\nfrom gangrun.compat import TorchDistributor\n"
        "from gangrun.errors import *\nn = len(gangrun.accelerators())\n"
        "gangrun.checkpoint.latest('x')\n"
    )
    assert private_uses(ok) == []
    assert is_public("gangrun.compat.frameworks", "deepspeed_setup")  # in the reference


# Run in a fresh interpreter: what a user's first `import` sees, no module already loaded by
# another test. Prints one JSON object: {"missing": [...], "absent": [...]}.
_RESOLVE = r"""
import importlib, json, sys
optional = set(sys.argv[2].split(","))
missing, absent = [], []
for mod in sys.argv[1].split(","):
    m = importlib.import_module(mod)
    for name in m.__all__:
        try:
            getattr(m, name)
        except ModuleNotFoundError as e:
            if (e.name or "").split(".")[0] in optional:
                absent.append(f"{mod}.{name}: {e.name}")
            else:
                missing.append(f"{mod}.{name}: {type(e).__name__}: {e}")
        except Exception as e:
            missing.append(f"{mod}.{name}: {type(e).__name__}: {e}")
    try:
        exec(f"from {mod} import *", {})
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] not in optional:
            missing.append(f"from {mod} import *: {e}")
    except Exception as e:
        missing.append(f"from {mod} import *: {type(e).__name__}: {e}")
    for name in dir(m):
        if name in getattr(m, "_LAZY", {}) and name not in m.__all__:
            missing.append(f"{mod}.{name}: lazily loaded but not in __all__")
print(json.dumps({"missing": missing, "absent": absent}))
"""


def test_every_name_of_every_public_module_resolves():
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    out = subprocess.run(
        [sys.executable, "-c", _RESOLVE, ",".join(PUBLIC), ",".join(sorted(OPTIONAL))],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["missing"] == [], "\n".join(result["missing"])


def test_every_public_module_declares_what_it_exports():
    for mod in PUBLIC:
        assert _all(mod), f"{mod} has no __all__"
    # the names loaded on first use are exported, and each one's module exists
    for mod, lazy in (
        ("gangrun", "_LAZY"),
        ("gangrun.data", "_WHERE"),
        ("gangrun.tracking", "_CALLER_SIDE"),
    ):
        tree = ast.parse(_module_path(mod).read_text())  # type: ignore[union-attr]
        found = {}
        for node in tree.body:
            if (
                isinstance(node, ast.Assign)
                and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id == lazy
            ):
                found = ast.literal_eval(node.value)
        assert found, f"{mod}.{lazy}"
        for name, where in found.items():
            assert _module_path(where) is not None, f"{mod}.{name}: {where} is not a module"
            assert name in _all(mod), f"{mod}.{name} is loaded on first use but not exported"
