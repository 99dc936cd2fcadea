"""No gangrun module uses another gangrun module's private names.

Read with ``ast`` over ``src/gangrun``: ``from x import _name`` (``x`` a gangrun module),
``mod._name`` (``mod`` bound to a gangrun module by an import), and ``obj._name`` or
``getattr(obj, "_name")`` on any other object when ``_name`` is a private attribute that
only other gangrun modules define (on ``self``/``cls``, in a class body or at top level).
A module's own private names, dunder names, and the private names of other libraries are
fine; a private *module* (``gangrun._log``) is the package's own and importable.
What two modules share is public: give it a name without the underscore.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

from test_layers import MODULES, SRC  # every module of src/gangrun, by dotted name


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and len(name) > 1


@dataclass
class Module:
    name: str
    path: Path
    tree: ast.Module
    top: set[str] = field(default_factory=set)  # private names defined at top level
    attrs: set[str] = field(default_factory=set)  # private attributes it owns
    aliases: dict[str, str] = field(default_factory=dict)  # local name -> gangrun module
    foreign: set[str] = field(default_factory=set)  # local names bound to other libraries

    @property
    def package(self) -> str:
        return self.name if self.path.name == "__init__.py" else self.name.rsplit(".", 1)[0]


def _resolve(mod: Module, node: ast.ImportFrom) -> str | None:
    """The gangrun module (or package) ``from ... import`` reads, else None."""
    if node.level:
        parts = mod.package.split(".")
        base = ".".join(parts[: len(parts) - node.level + 1])
        return f"{base}.{node.module}" if node.module else base
    if node.module and node.module.split(".")[0] == "gangrun":
        return node.module
    return None


def _targets(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, (ast.Tuple, ast.List)):
        return [n for e in node.elts for n in _targets(e)]
    return []


def _load(name: str, path: Path, text: str | None = None) -> Module:
    source = path.read_text() if text is None else text
    mod = Module(name, path, ast.parse(source, str(path)))
    for node in mod.tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            mod.top.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                mod.top.update(_targets(t))
    mod.top = {n for n in mod.top if _private(n)}
    for node in ast.walk(mod.tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    mod.attrs.add(item.name)
                elif isinstance(item, (ast.Assign, ast.AnnAssign)):
                    for t in item.targets if isinstance(item, ast.Assign) else [item.target]:
                        mod.attrs.update(_targets(t))
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in ("self", "cls")
        ):
            mod.attrs.add(node.attr)  # inherited ones too (a stdlib base class's)
        elif isinstance(node, ast.Import):
            for a in node.names:
                local = a.asname or a.name.split(".")[0]
                if a.name.split(".")[0] == "gangrun":
                    mod.aliases[local] = a.name if a.asname else "gangrun"
                else:
                    mod.foreign.add(local)
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(mod, node)
            for a in node.names:
                local = a.asname or a.name
                if target is None:
                    mod.foreign.add(local)
                elif f"{target}.{a.name}" in MODULES:
                    mod.aliases[local] = f"{target}.{a.name}"
    mod.attrs = {n for n in mod.attrs if _private(n)} | mod.top
    return mod


LOADED = {name: _load(name, path) for name, path in MODULES.items()}
OWNERS: dict[str, set[str]] = {}  # private attribute -> the modules that define it
for _m in LOADED.values():
    for _a in _m.attrs:
        OWNERS.setdefault(_a, set()).add(_m.name)


def _reach(mod: Module, obj: ast.expr, name: str) -> str | None:
    """Why ``obj.name`` in ``mod`` is a reach-in, else None."""
    if not _private(name) or name in mod.attrs:
        return None
    if isinstance(obj, ast.Name):
        if obj.id in ("self", "cls") or obj.id in mod.foreign:
            return None
        target = mod.aliases.get(obj.id)
        if target is not None:
            if f"{target}.{name}" in MODULES:
                return None  # a private module of the package
            return f"{target}.{name}"
    owners = OWNERS.get(name, set()) - {mod.name}
    return f"{sorted(owners)[0]}: .{name}" if owners else None


def violations(mod: Module) -> list[str]:
    out = []
    for node in ast.walk(mod.tree):
        where = f"{mod.path.relative_to(SRC)}:{getattr(node, 'lineno', 0)}"
        why: str | None = None
        if isinstance(node, ast.ImportFrom):
            target = _resolve(mod, node)
            if target is None or target == mod.name:
                continue
            for a in node.names:
                if _private(a.name) and f"{target}.{a.name}" not in MODULES:
                    out.append(f"{where}: from {target} import {a.name}")
        elif isinstance(node, ast.Attribute):
            why = _reach(mod, node.value, node.attr)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            why = _reach(mod, node.args[0], node.args[1].value)
        if why is not None:
            out.append(f"{where}: {why}")
    return out


def test_no_module_uses_another_modules_private_names() -> None:
    found = [v for mod in LOADED.values() for v in violations(mod)]
    assert not found, "cross-module private names (make them public):\n" + "\n".join(found)


def _check(source: str, name: str = "gangrun.lifecycle.probe") -> list[str]:
    path = SRC / (name.replace(".", "/") + ".py")
    return [v.split(": ", 1)[1] for v in violations(_load(name, path, source))]


def test_the_check_sees_each_kind_of_reach_in() -> None:
    # from-imports of another module's private name (absolute and relative)
    assert _check("from gangrun.api import _release_run") == [
        "from gangrun.api import _release_run"
    ]
    assert _check("from ..api import _release_run") == ["from gangrun.api import _release_run"]
    # module._name on an imported gangrun module
    assert _check("from .. import api\napi._release_run") == ["gangrun.api._release_run"]
    assert _check("import gangrun.api as a\na._release_run") == ["gangrun.api._release_run"]
    # another class's private attribute, by attribute access and by getattr
    assert _check("def f(h):\n    return h._finalizer") == ["gangrun.api: ._finalizer"]
    assert _check("def f(h):\n    return getattr(h, '_finalizer', None)") == [
        "gangrun.api: ._finalizer"
    ]


def test_the_check_lets_own_dunder_and_foreign_names_be() -> None:
    own = "class C:\n    def __init__(self):\n        self._finalizer = 1\n"
    assert _check(own + "def f(c):\n    return c._finalizer") == []  # its own attribute
    assert _check("def _helper(): ...\nx = _helper") == []
    assert _check("import os\nos._exit") == []  # another library's private name
    assert _check("def f(h):\n    return h.__dict__, h._unheard_of_name") == []
    assert _check("from .. import _log\n_log.configure") == []  # a private module: the package's
