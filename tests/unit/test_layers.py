"""One-way dependencies inside ``src/gangrun`` (docs/architecture.md).

Every import of a gangrun module (top level or inside a function, ``TYPE_CHECKING`` blocks
included) is read with ``ast``, and so are the modules named by strings (the fork server's
preload list, the ``python -c`` boot lines, the prewarm lists). A module may import its own
layer or lower ones, never a higher one; the rank side (``gangrun.rank``: everything that runs
inside a rank process) imports only the rank side and the platform helpers; and there is no
import cycle between modules.

Layers are package-based: one rule per package (``launch`` covers every module under
launch/), and two for the modules directly in ``gangrun/``: the face (a short list: the
package, ``api``, ``defaults``...) is the API layer, every other one is platform. There is
no per-module exception: a module whose role differs from its package's moves to the package
of its role. A package without a rule fails the test.

A module looked up by name in ``sys.modules`` (``sys.modules["gangrun.x"]``,
``sys.modules.get("gangrun.x")``) is an import too: reading a higher layer's state that way
is the same upward edge. So is a module named in a lazy map (``{"Gang":
"gangrun.interactive.session"}``, read by a package's ``__getattr__``).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"

# layer: higher imports lower, never the reverse.
API, LIFECYCLE, LAUNCH, RANK, PLATFORM = 4, 3, 2, 1, 0
# One rule per package: every module under gangrun/<package>/ is in its package's layer.
LAYERS: dict[str, int] = {
    "cli": API,  # the gangrun command (entry, options, node, status...)
    "notebook": API,  # the notebook panel and its rendering, output routing, prewarm
    "interactive": API,  # Gang: a long-lived call over the public API
    "compat": API,
    "lifecycle": LIFECYCLE,
    "launch": LAUNCH,
    # the rank side: runs inside rank processes (fresh, forked by the fork server, on Ray)
    "rank": RANK,
    # platform-level helpers, usable from every layer and inside ranks
    "wire": PLATFORM,  # every format that crosses a process boundary
    "host": PLATFORM,  # what this machine has (system, accelerators, locks...)
    "tracking": PLATFORM,  # MLflow, caller side (the rank's part: gangrun.rank)
    "data": PLATFORM,  # user-facing inside ranks: helpers only
    "checkpoint": PLATFORM,  # DCP save/load (gangrun.Checkpointer: gangrun.rank)
}
# The modules directly in gangrun/: these are the face (the API layer); every other one is
# a platform helper (the settings, the errors, the output, the logger...).
TOP_LEVEL_API = {
    "gangrun",  # the package's __init__: re-exports the API
    "gangrun.__main__",
    "gangrun.api",
    "gangrun.option_kwargs",  # the decorator's typed keyword arguments
    "gangrun.checks",  # mistakes caught before anything starts (every submit())
    "gangrun.defaults",
    "gangrun.plain",  # a plain call of a decorated function: a world of one
}
# Packages with a rule that another branch is adding: the rule is ready before they land,
# and the test below fails once they have, so the entry leaves this set.
ARRIVING: set[str] = set()
# Modules that run inside a rank (layer RANK): they, and everything they import, may be in
# these layers only.
RANK_SIDE_MAY_IMPORT = {RANK, PLATFORM}
# Modules whose module-name strings name what a rank imports: the fork server's preloads
# (every forked rank inherits them) and the fresh rank's boot line.
RANK_STRINGS_IN = ("gangrun.launch.forkserver.server", "gangrun.launch.spawn")


def _modules() -> dict[str, Path]:
    out = {}
    for p in sorted((SRC / "gangrun").rglob("*.py")):
        parts = list(p.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p
    return out


MODULES = _modules()


def _imports(mod: str, path: Path) -> set[str]:
    """Every gangrun module ``mod`` imports (``from . import x`` resolves to the module
    ``x`` when it is one, else to the package)."""
    pkg = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "gangrun")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = pkg.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                target = f"{base}.{node.module}" if node.module else base
            elif node.module and node.module.split(".")[0] == "gangrun":
                target = node.module
            else:
                continue
            for a in node.names:
                sub = f"{target}.{a.name}"
                found.add(sub if sub in MODULES else target)
    return _existing(found) - {mod}


def _existing(names: set[str]) -> set[str]:
    """Each name, or its package when it is not a module (a package attribute)."""
    while True:
        bad = {m for m in names if m not in MODULES}
        if not bad:
            return names
        names = (names - bad) | {m.rsplit(".", 1)[0] for m in bad}


_CODE_IMPORT = re.compile(r"(?:^|[;\s])(?:from|import) (gangrun(?:\.\w+)*)")
_MODULE_NAME = re.compile(r"gangrun(?:\.\w+)+")


def _named(path: Path) -> set[str]:
    """The gangrun modules ``path`` names by string: in ``python -c`` code (``"...; from
    gangrun.x import y"``), in sequences of module names (a preload or prewarm list) and in
    ``sys.modules`` look-ups. Docstrings are prose, not imports."""
    tree = ast.parse(path.read_text(), str(path))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    found: set[str] = set()
    for node in ast.walk(tree):
        looked_up = _sys_modules_key(node)
        if looked_up is not None and looked_up.split(".")[0] == "gangrun":
            found.add(looked_up)
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if id(node) not in docstrings:
                found.update(_CODE_IMPORT.findall(node.value))
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)):
            # a sequence of module names, or a lazy map's values (name -> its module)
            elts = node.values if isinstance(node, ast.Dict) else node.elts
            values = [e.value for e in elts if isinstance(e, ast.Constant)]
            if elts and len(values) == len(elts) and all(isinstance(v, str) for v in values):
                found.update(v for v in values if _MODULE_NAME.fullmatch(v))
    return found


def _sys_modules_key(node: ast.AST) -> str | None:
    """The module name in ``sys.modules["name"]`` or ``sys.modules.get("name"...)``."""

    def is_sys_modules(n: ast.AST) -> bool:
        return (
            isinstance(n, ast.Attribute)
            and n.attr == "modules"
            and isinstance(n.value, ast.Name)
            and n.value.id == "sys"
        )

    key: ast.AST | None = None
    if isinstance(node, ast.Subscript) and is_sys_modules(node.value):
        key = node.slice
    elif (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "get"
        and is_sys_modules(node.func.value)
        and node.args
    ):
        key = node.args[0]
    if isinstance(key, ast.Constant) and isinstance(key.value, str):
        return key.value
    return None


def layer(mod: str) -> int:
    """The layer of ``mod``'s top-level package, or, directly in gangrun/, API for the face
    and PLATFORM for everything else."""
    parts = mod.split(".")
    if mod in TOP_LEVEL_API:
        return API
    if len(parts) > 1 and (SRC / "gangrun" / parts[1]).is_dir():
        assert parts[1] in LAYERS, f"package gangrun.{parts[1]} has no rule in {__file__}"
        return LAYERS[parts[1]]
    return PLATFORM


NAMED = {m: _named(p) for m, p in MODULES.items()}
GRAPH = {m: _imports(m, p) | (_existing(NAMED[m]) - {m}) for m, p in MODULES.items()}


def test_every_module_has_a_layer():
    for mod in MODULES:
        layer(mod)


def test_one_rule_per_package_and_every_rule_names_what_exists():
    # No per-module exception: a rule names a package, or a module directly in gangrun/.
    packages = {p.name for p in (SRC / "gangrun").iterdir() if (p / "__init__.py").is_file()}
    assert packages - set(LAYERS) == set(), "packages without a rule"
    assert set(LAYERS) - packages == ARRIVING, "rules for packages that do not exist"
    for mod in TOP_LEVEL_API:
        assert mod in MODULES and mod.count(".") <= 1, f"{mod}: not a module of gangrun/"


def test_modules_named_by_string_exist():
    bad = [
        f"{m} names {n}" for m, names in NAMED.items() for n in sorted(names) if n not in MODULES
    ]
    assert not bad, "modules named by string that do not exist:\n" + "\n".join(bad)


def test_the_fork_server_preloads_and_the_boot_line_are_rank_side():
    named = {n: m for m in RANK_STRINGS_IN for n in NAMED[m]}
    assert "gangrun.rank.boot" in named and "gangrun.rank.forkchild" in named, named
    bad = [f"{m} names {n}" for n, m in named.items() if layer(n) not in RANK_SIDE_MAY_IMPORT]
    assert not bad, "a rank would import caller-side code:\n" + "\n".join(bad)


def test_no_upward_import():
    bad = [
        f"{m} (layer {layer(m)}) imports {d} (layer {layer(d)})"
        for m, deps in GRAPH.items()
        for d in sorted(deps)
        if layer(d) > layer(m) and not (d != "gangrun" and m.startswith(d + "."))
    ]
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_rank_side_imports_nothing_caller_side():
    # Everything a rank module reaches, however indirectly (what it imports, what that
    # imports...), is rank side or platform.
    rank_side = [m for m in MODULES if layer(m) == RANK]
    assert {"gangrun.rank.worker", "gangrun.rank.boot", "gangrun.rank.forkchild"} <= set(rank_side)
    seen: dict[str, str] = {m: m for m in rank_side}  # module -> the rank module reaching it
    todo = list(rank_side)
    while todo:
        m = todo.pop()
        for d in GRAPH[m]:
            if d not in seen:
                seen[d] = seen[m]
                todo.append(d)
    bad = [f"{seen[d]} reaches {d}" for d in sorted(seen) if layer(d) not in RANK_SIDE_MAY_IMPORT]
    assert not bad, "the rank side imports caller-side code:\n" + "\n".join(bad)


def test_no_import_cycle():
    # A package's __init__ importing its own submodules (re-exports) and the submodules
    # importing the package's shared types is one unit, not a cycle between modules.
    def edges(m: str) -> set[str]:
        return {d for d in GRAPH[m] if not (d.startswith(m + ".") or m.startswith(d + "."))}

    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(edges(m)):
            if state.get(d) == 1:
                cycle = stack[stack.index(d) :] + [d]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(MODULES):
        if m not in state:
            visit(m)


def test_the_checker_sees_imports_inside_functions(tmp_path):
    path = tmp_path / "x.py"
    path.write_text("def f():\n    from ..api import distributed\n    import gangrun.cli\n")
    assert _imports("gangrun.lifecycle.x", path) == {"gangrun.api", "gangrun.cli"}
    assert layer("gangrun.lifecycle.x") < layer("gangrun.api")


def test_the_checker_reads_module_names_in_strings(tmp_path):
    path = tmp_path / "x.py"
    path.write_text(
        '"""Docstring: >>> from gangrun import api"""\n'
        'BOOT = "import sys; from gangrun.rank.boot import boot; boot()"\n'
        'PRELOAD = ("gangrun.rank.worker", "json", "gangrun.nope")\n'
        'log = "gangrun.logger.name"\n'
        'running = sys.modules["gangrun.cli.entry"].RUNNING\n'
        'sampler = sys.modules.get("gangrun.data.sampler")\n'
        '_LAZY = {"Gang": "gangrun.interactive.session", "x": "gangrun.api"}\n'
    )
    assert _named(path) == {
        "gangrun.rank.boot",
        "gangrun.rank.worker",
        "gangrun.nope",
        "gangrun.cli.entry",
        "gangrun.data.sampler",
        "gangrun.interactive.session",
        "gangrun.api",
    }
